"""train.precision = "bf16" (the CPU reference, backend/cpu/precision.py) on every parallel layout (dp; ZeRO 1, 2, 3;
pp under 1F1B, GPipe, zero-bubble and interleaved 1F1B; each with the math and flash attention and with recompute;
tp; train.deterministic) equals one process training the same config in bf16, and differs from fp32 training (the
layouts really run the rounding).

Run under ``mpiexec -n 1`` (all skip) and ``-n 2`` by tests/test_suites.py; a layout whose ranks do not divide the world
skips. The global batch grows with dp so every rank gets the same share. The reference is each rank training alone
on COMM_SELF with dp × the micro-batches, so that its micro-batches are the layout's: bf16 rounds each
micro-batch's weight gradient before it is summed, so the split of the batch is part of the arithmetic.

Tolerances (the largest difference of any tensor relative to that tensor's largest value, after 4 SGD steps):
dp, ZeRO and pp compute every micro-batch's products on the same rows as one process; only the float32 sums of
the micro-batches' rounded gradients run in another order (the Allreduce's, the pipeline's), so they stay within
float32 noise of one process (``NEAR`` = 1e-6, as the fp32 layouts' tests/mpi/test_gpt_parallel.py; measured
~1.1e-7), while bf16 and fp32 training are ~5e-3 apart (``APART`` = 1e-3 at least). tp = 2 rounds at other points:
the row-parallel products (attention's and the MLP's output projections, and the column-parallel layers' input
gradients) sum two ranks' partial products, each rounded to bfloat16 before the Allreduce, where one process rounds
the whole sum once, as Megatron's bf16 partial sums do. That is a different bf16 run, not float32 noise away from
one process's: it is as far from one process's bf16 run as rounding itself moves training (measured 5.3e-3 against
one process's bf16-to-fp32 5.1e-3), so the test holds it to at most twice that distance, and at least ``APART``
from fp32 (it does round).
"""

import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

from helpers import gpt_config, train_params as train

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
NEAR = 1e-6
APART = 1e-3

LAYOUTS = {  # name: (parallel settings, ranks one copy of the model spans); tp has its own test below
    "dp": ({}, 1),
    "zero-1": ({"zero": 1}, 1),
    "zero-2": ({"zero": 2}, 1),
    "pp": ({"pp": 2}, 2),
    "pp-gpipe": ({"pp": 2, "schedule": "gpipe"}, 2),
    "pp-zero-bubble": ({"pp": 2, "schedule": "zero-bubble"}, 2),
    "pp-interleaved": ({"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2}, 2),
    "zero-3": ({"zero": 3}, 1),
}


def cfg_for(path, comm, layout, precision="bf16", recompute="none", **model):
    parallel, span = LAYOUTS[layout]
    dp = comm.size // span
    return gpt_config(path, model=model, optim=SGD, parallel=dict(parallel),
                      train={"batch_size": 4 * dp, "micro_batches": 2, "grad_clip": 1.0, "precision": precision,
                             "recompute": recompute})


def alone(cfg, dp):
    single = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, micro_batches=cfg.train.micro_batches * dp),
        parallel=dataclasses.replace(cfg.parallel, pp=1, tp=1, stages=(), dp="auto", schedule="1f1b", zero=0,
                                    virtual_stages=1))
    return train(single, MPI.COMM_SELF)


def max_error(got, want) -> float:
    """The largest difference of any tensor relative to that tensor's largest value."""
    assert set(got) == set(want)
    return max(float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)) for n in want)


@pytest.mark.parametrize("variant", ["math", "flash", "recompute"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_on_every_layout_equals_one_process_in_bf16(comm, tokens, layout, variant):
    """``recompute``: the blocks' forward run again in backward rounds at the same points (the math attention)."""
    span = LAYOUTS[layout][1]
    if comm.size % span or comm.size == 1:
        pytest.skip(f"the {layout} layout needs a world of a multiple of {span} and at least 2 ranks")
    cfg = cfg_for(tokens, comm, layout, attention="flash" if variant == "flash" else "math",
                  recompute="blocks" if variant == "recompute" else "none")
    got = train(cfg, comm)
    want = alone(cfg, comm.size // span)
    fp32 = alone(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="fp32")), comm.size // span)
    near, apart = max_error(got, want), max_error(got, fp32)
    print(f"\n{layout} {variant}: from one process in bf16 {near:.2e}, from fp32 {apart:.2e}")
    assert near < NEAR, near
    assert apart > APART, apart


def test_bf16_tensor_parallel_is_a_bf16_run_as_far_from_one_process_as_rounding_moves_it(comm, tokens):
    if comm.size % 2:
        pytest.skip("tp = 2 needs an even number of ranks")
    dp = comm.size // 2
    cfg = gpt_config(tokens, optim=SGD, parallel={"tp": 2},
                     train={"batch_size": 4 * dp, "micro_batches": 2, "grad_clip": 1.0, "precision": "bf16"})
    got, want = train(cfg, comm), alone(cfg, dp)
    fp32 = alone(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="fp32")), dp)
    near, apart, rounding = max_error(got, want), max_error(got, fp32), max_error(fp32, want)
    print(f"\ntp: from one process in bf16 {near:.2e}, from fp32 {apart:.2e}; one process bf16 to fp32 {rounding:.2e}")
    assert near < 2 * rounding, (near, rounding)
    assert apart > APART, apart


def test_bf16_pipeline_checkpoint_resumes_in_fp32_on_one_process(comm, tokens, shared_dir):
    """Two bf16 steps on the pipeline (each stage writes its part of the float32 master), two more in fp32 on one
    process: the resume accepts the change of precision and picks up at step 2."""
    if comm.size % 2:
        pytest.skip("a two-stage pipeline needs an even number of ranks")
    ck = f"{shared_dir}/ck"
    cfg = cfg_for(tokens, comm, "pp")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2),
                              checkpoint=dataclasses.replace(cfg.checkpoint, dir=ck))
    train(cfg, comm)
    outcome = np.zeros(1)
    if comm.rank == 0:  # every rank learns the outcome: one failing alone would leave the others in a collective
        lines = []
        from hpctrain.parallel.mesh import Mesh
        from hpctrain.train import Trainer

        mesh = Mesh(comm=MPI.COMM_SELF)
        resumed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4, precision="fp32"),
                                      parallel=dataclasses.replace(cfg.parallel, pp=1))
        t = Trainer(resumed, mesh=mesh, log=lines.append)
        t.run()
        t.close()
        mesh.free()
        outcome[0] = float(any("at step 2" in line for line in lines) and t.optim.step_count == 4)
    comm.Bcast(outcome, root=0)
    assert outcome[0] == 1.0


def test_deterministic_bf16_is_bitwise_one_process(comm, tokens):
    """train.deterministic: each logical shard is one micro-batch wherever it runs, so bf16 rounds at the same points
    on every layout, and the fixed tree sums the shards' float32 gradients in one order: the same bits as one
    process."""
    if comm.size == 1:
        pytest.skip("needs at least 2 ranks")
    train_keys = {"batch_size": 8, "steps": 4, "deterministic": True, "deterministic_shards": 2 * comm.size,
                  "precision": "bf16", "grad_clip": 1.0}
    cfg = gpt_config(tokens, optim={"name": "adamw", "lr": 0.01}, train=train_keys)
    got = train(cfg, comm)
    want = train(cfg, MPI.COMM_SELF)
    assert all(np.array_equal(got[n], want[n]) for n in want)
    fp32 = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="fp32")), MPI.COMM_SELF)
    assert max_error(got, fp32) > APART
