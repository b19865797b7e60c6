"""The GPT under data and pipeline parallelism equals one process; its checkpoints move between layouts.

Run under ``mpiexec -n 1``, ``-n 2`` and ``-n 4`` by tests/test_suites.py. dp is the world size,
or world / 2 with a two-stage pipeline (the embedding on the first stage, the tied head on the
last), and the global batch grows with dp so every rank gets the same share. The reference is
each rank training the same config alone on COMM_SELF.
"""

import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

from helpers import gpt_config, train_params as train


SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
# AdamW turns rounding noise into lr-sized steps where a gradient is zero in exact arithmetic: the key
# bias of c_attn (softmax ignores a shift shared by a row's scores) gets only rounding noise, so two
# summation orders differ there by ~1e-5 of the tensor's largest value; SGD stays at ~1e-7
ADAMW_RTOL = 1e-4


def cfg_for(path, comm, pp, **sections):
    dp = comm.size // pp
    sections.setdefault("train", {}).update(batch_size=4 * dp)
    sections.setdefault("parallel", {}).update(pp=pp)
    sections.setdefault("optim", SGD)
    return gpt_config(path, **sections)


def alone(cfg):
    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1, stages=(), dp="auto",
                                                                   schedule="1f1b", virtual_stages=1, zero=0))
    return train(single, MPI.COMM_SELF)


def max_error(got, want) -> float:
    """The largest difference of any tensor relative to that tensor's largest value."""
    assert set(got) == set(want)
    return max(float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)) for n in want)


def assert_close(got, want, rtol=1e-6):
    worst = max_error(got, want)
    assert worst < rtol, worst


def test_data_parallel_gpt_equals_one_process(comm, tokens):
    cfg = cfg_for(tokens, comm, 1, train={"grad_clip": 1.0, "micro_batches": 2})
    assert_close(train(cfg, comm), alone(cfg))


def test_adamw_gpt_on_every_layout_equals_one_process(comm, tokens):
    pp = 2 if comm.size % 2 == 0 else 1
    cfg = cfg_for(tokens, comm, pp, train={"micro_batches": 2}, optim={"name": "adamw", "lr": 0.01})
    assert_close(train(cfg, comm), alone(cfg), rtol=ADAMW_RTOL)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero-bubble"])
@pytest.mark.parametrize("stages", [(), ((0, 1), (2, 3)), ((0, 2), (3, 3))], ids=["balanced", "even", "head-alone"])
def test_pipeline_gpt_equals_one_process(comm, tokens, schedule, stages):
    """The tied embedding: its replica on the last stage and the owner's sum their gradients."""
    if comm.size % 2:
        pytest.skip("a two-stage pipeline needs an even number of ranks")
    cfg = cfg_for(tokens, comm, 2, train={"grad_clip": 1.0, "micro_batches": 2},
                  parallel={"schedule": schedule, "stages": [list(s) for s in stages]})
    assert_close(train(cfg, comm), alone(cfg))


@pytest.mark.parametrize("schedule", ["zero-bubble", "zero-bubble-h2"])
def test_four_stage_split_backward_gpt_equals_one_process(comm, tokens, schedule):
    """pp = 4 (embedding, block 0, block 1, head with the tied replica) with 4 micro-batches: the stages' W
    passes run in other orders under ZB-H2's larger in-flight limits than under ZB-H1, the training is the same."""
    if comm.size != 4:
        pytest.skip("a four-stage pipeline needs 4 ranks")
    cfg = cfg_for(tokens, comm, 4, train={"grad_clip": 1.0, "micro_batches": 4}, parallel={"schedule": schedule})
    assert_close(train(cfg, comm), alone(cfg))


@pytest.mark.parametrize("variant", ["plain", "recompute", "zero-2", "dropout"])
def test_interleaved_gpt_equals_one_process(comm, tokens, variant):
    """pp = 2 with two model chunks per stage: stage 0 runs the embedding and block 1, stage 1 block 0 and the
    head with the tied table's replica; with recompute, with ZeRO over the dp the world leaves, with dropout
    (its masks a function of the sample, not of the layout)."""
    if comm.size % 2:
        pytest.skip("a two-stage pipeline needs an even number of ranks")
    train_cfg = {"grad_clip": 1.0, "micro_batches": 2, **({"recompute": "blocks"} if variant == "recompute" else {})}
    cfg = cfg_for(tokens, comm, 2, train=train_cfg, model={"dropout": 0.1} if variant == "dropout" else {},
                  parallel={"schedule": "interleaved-1f1b", "virtual_stages": 2,
                            "zero": 2 if variant == "zero-2" else 0})
    assert_close(train(cfg, comm), alone(cfg))


@pytest.mark.parametrize("layout", ["dp", "pp-zero-bubble", "pp-recompute"])
def test_flash_attention_trains_every_layout_as_one_process_on_the_math_attention(comm, tokens, layout):
    """model.attention = "flash" (no probabilities kept, recomputed in backward; with dropout, its mask drawn
    inside the flash passes) trains as one process on the math attention, to float32 rounding."""
    pp = 1 if layout == "dp" else 2
    if comm.size % pp:
        pytest.skip("a two-stage pipeline needs an even number of ranks")
    train_keys = {"grad_clip": 1.0, "micro_batches": 2, "recompute": "blocks" if layout == "pp-recompute" else "none"}
    cfg = cfg_for(tokens, comm, pp, model={"dropout": 0.2, "attention": "flash"}, train=train_keys,
                  parallel={"schedule": "zero-bubble" if layout == "pp-zero-bubble" else "1f1b"})
    assert_close(train(cfg, comm), alone(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                                          attention="math"))))


@pytest.mark.parametrize("layout", ["dp", "pp-zero-bubble", "pp-recompute"])
def test_dropout_trains_every_layout_as_one_process(comm, tokens, layout):
    """model.dropout: a sample's masks follow its place in the step's global batch, its positions and channels
    (nn/dropout.py), so a data-parallel share, a micro-batch, a pipeline stage and a recomputed forward draw what
    one process draws; and they do drop (the run differs from dropout = 0)."""
    pp = 1 if layout == "dp" else 2
    if comm.size % pp:
        pytest.skip("a two-stage pipeline needs an even number of ranks")
    train_keys = {"grad_clip": 1.0, "micro_batches": 2}
    if layout == "pp-recompute":
        train_keys["recompute"] = "blocks"
    cfg = cfg_for(tokens, comm, pp, model={"dropout": 0.2}, train=train_keys,
                  parallel={"schedule": "zero-bubble" if layout == "pp-zero-bubble" else "1f1b"})
    want = alone(cfg)
    assert_close(train(cfg, comm), want)
    plain = alone(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.0)))
    assert max_error(plain, want) > 1e-3


def test_pipeline_gpt_checkpoint_resumes_on_one_process(comm, tokens, shared_dir):
    """Two steps on the pipeline, a checkpoint, two more on one process == four steps on one process."""
    if comm.size % 2:
        pytest.skip("a two-stage pipeline needs an even number of ranks")
    ck = f"{shared_dir}/ck"
    cfg = cfg_for(tokens, comm, 2, train={"steps": 2}, checkpoint={"dir": ck})
    train(cfg, comm)
    worst = np.zeros(1)
    if comm.rank == 0:  # every rank learns the outcome: one failing alone would leave the others in a collective
        resumed = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4),
                                            parallel=dataclasses.replace(cfg.parallel, pp=1)), MPI.COMM_SELF)
        straight = alone(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4),
                                             checkpoint=dataclasses.replace(cfg.checkpoint, dir="")))
        worst[0] = max_error(resumed, straight)
    comm.Bcast(worst, root=0)
    assert worst[0] < 1e-6


def test_gpt_validation_loss_matches_one_process(comm, tokens):
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    pp = 2 if comm.size % 2 == 0 else 1
    cfg = cfg_for(tokens, comm, pp)
    results = []
    for c, group in ((cfg, comm), (dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1)),
                                   MPI.COMM_SELF)):
        mesh = Mesh(comm=group, dp="auto", pp=c.parallel.pp)
        t = Trainer(c, mesh=mesh, log=lambda *a: None)
        results.append(t.evaluate())
        t.close()
        mesh.free()
    assert results[0]["val_loss"] == pytest.approx(results[1]["val_loss"], rel=1e-6)


def test_random_windows_on_every_layout_equal_one_process(comm, tokens):
    """data.sampling = "random": the windows of a step are drawn from the seed and the step, then cut by rank and
    micro-batch, so dp, pp and micro-batches train on the same samples as one process."""
    pp = 2 if comm.size % 2 == 0 else 1
    cfg = cfg_for(tokens, comm, pp, train={"micro_batches": 2}, data={"sampling": "random", "seed": 7})
    assert_close(train(cfg, comm), alone(cfg))
