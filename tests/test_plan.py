"""hpctrain plan: every rank's bytes from a config and a world size, without MPI or the data.

The planner and a run share one description (hpctrain/plan.py: RankMemory); the figures here are checked
against what the parts and the optimizer really allocate, built the same way a Trainer builds them.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from helpers import config, gpt_config
from hpctrain.errors import ConfigError, LayoutError
from hpctrain.nn import make_model
from hpctrain.plan import RankMemory, advice, parse_size, plan, plan_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_zero_divides_the_optimizer_state_and_zero_2_the_gradients():
    cfg = config("x.h5", hidden=512, optim={"name": "adam", "lr": 1e-3}, train={"batch_size": 16},
                 parallel={"bucket_mb": 0.1})
    n = 6 * 512 + 512 + 512 * 2 + 512 * 512 + 512 + 512 * 3 + 3
    plain = plan(cfg, 4)
    assert [m.rank for m in plain] == [0, 1, 2, 3]
    assert all(m.params_bytes == m.grads_bytes == 4 * n and m.optimizer_bytes == 8 * n for m in plain)
    for zero in (1, 2):
        ranks = plan(config("x.h5", hidden=512, optim={"name": "adam", "lr": 1e-3}, train={"batch_size": 16},
                            parallel={"bucket_mb": 0.1, "zero": zero}), 4)
        assert sum(m.optimizer_bytes for m in ranks) == 8 * n  # each value's state on one rank
        assert all(m.optimizer_bytes <= 8 * (n / 4 + 16 * 11) for m in ranks)
        bucket = int(0.1e6 / 4)
        assert all(m.grads_bytes == (4 * n if zero == 1 else min(4 * n, m.optimizer_bytes // 2 + 8 * bucket))
                   for m in ranks)
    # with micro-batches zero = 2 accumulates in the whole buffer and scatters once, after the last backward: at
    # the peak the gradients are whole, as with zero = 1 (and that is what the advice counts)
    whole = plan(config("x.h5", hidden=512, optim={"name": "adam", "lr": 1e-3},
                        train={"batch_size": 16, "micro_batches": 2}, parallel={"bucket_mb": 0.1, "zero": 2}), 4)
    assert all(m.grads_bytes == 4 * n for m in whole)


def test_pipeline_and_tensor_parallel_split_the_parameters():
    cfg = gpt_config("t.h5", train={"batch_size": 8})
    whole = plan(cfg, 1)[0].params_bytes
    four = plan(gpt_config("t.h5", train={"batch_size": 8}, parallel={"pp": 2, "tp": 2}), 4)
    assert [(m.stage, m.tp_rank) for m in four] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(m.params_bytes < whole for m in four)
    assert all(m.buffer_bytes > 0 for m in four)  # the pipeline's receive rings


def test_interleaved_chunks_split_each_stage_and_hold_more_passes():
    """pp = 2 with two chunks per stage: each stage holds two of the GPT's four units (stage 0 the embedding and
    block 1, with the tied table; stage 1 block 0 and the head), the same parameters in all as 1F1B's cut, and
    plans Megatron's larger peak of chunk passes."""
    base = dict(train={"batch_size": 8, "micro_batches": 4})
    plain = plan(gpt_config("t.h5", parallel={"pp": 2}, **base), 2)
    chunked = plan(gpt_config("t.h5", parallel={"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2},
                              **base), 2)
    assert [m.stage for m in chunked] == [0, 1]
    whole = plan(gpt_config("t.h5", **base), 1)[0].params_bytes
    wte = 4 * 12 * 8  # the tied table's replica on the last stage
    assert sum(m.params_bytes for m in chunked) == sum(m.params_bytes for m in plain) == whole + wte
    assert all(m.activation_bytes > 0 and m.buffer_bytes > 0 for m in chunked)
    assert chunked[0].buffer_bytes > plain[0].buffer_bytes  # stage 0 now receives activations (for its chunk 1)


def test_recompute_plans_less_activation_memory():
    base = dict(train={"batch_size": 8, "micro_batches": 2})
    stored = plan(gpt_config("t.h5", **base), 1)[0]
    kept = plan(gpt_config("t.h5", train={**base["train"], "recompute": "blocks"}), 1)[0]
    assert kept.activation_bytes < stored.activation_bytes


def test_flash_attention_plans_no_probabilities():
    """model.attention = "flash" keeps lse[B, H, T] where "math" keeps att[B, H, T, T] (its output is c_proj's
    input, counted once), per block; and the working set's attention scratch: math's backward takes datt and
    dscores [B, H, T, T] (one [B, H, T, T] on a GPU), flash two arrays of the heads it takes at once (here all
    H) on the CPU, a float per row on a GPU."""
    model = {"block_size": 16, "n_head": 2, "n_layer": 3}
    B, H, T, L = 4, 2, 16, 3  # gpt_config's batch_size, one micro-batch
    pool = {"arena": False}  # a GPU without the step arena: arrays from the caching pool, counted as on the CPU
    for device, math_scratch, flash_scratch in ((False, 2 * B * H * T * T, 2 * H * T * T),
                                                (True, B * H * T * T, B * H * T)):
        math_plan = plan(gpt_config("t.h5", model=model, cuda=pool), 1, device=device)[0]
        flash_plan = plan(gpt_config("t.h5", model={**model, "attention": "flash"}, cuda=pool), 1, device=device)[0]
        assert math_plan.activation_bytes - flash_plan.activation_bytes == \
            (L * B * H * (T * T - T) + math_scratch - flash_scratch) * 4
    # with the arena (the default on a GPU: arena_plan.py) flash saves at least the probabilities math keeps
    math_plan = plan(gpt_config("t.h5", model=model), 1, device=True)[0]
    flash_plan = plan(gpt_config("t.h5", model={**model, "attention": "flash"}), 1, device=True)[0]
    assert math_plan.activation_bytes - flash_plan.activation_bytes >= L * B * H * (T * T - T) * 4


def test_advice_offers_flash_attention_where_the_probabilities_do_not_fit():
    model = {"block_size": 256, "n_head": 2, "n_layer": 2}
    cfg = gpt_config("t.h5", model=model)
    flash = max(m.total_bytes for m in plan(gpt_config("t.h5", model={**model, "attention": "flash"}), 1))
    worst = max(m.total_bytes for m in plan(cfg, 1))
    said = advice(cfg, 1, (worst + flash) // 2)
    assert any(line.startswith("--set model.attention=flash: largest rank") for line in said), said
    assert not any("attention" in line for line in advice(gpt_config("t.h5", model={**model, "attention": "flash"}),
                                                          1, flash - 1))
    # on a GPU only where the kernels take the heads (at most 128 channels)
    wide = {**model, "n_head": 1, "n_embd": 256}
    cfg = gpt_config("t.h5", model=wide, train={"backend": "cuda"})
    flash = max(m.total_bytes for m in plan(gpt_config("t.h5", model={**wide, "attention": "flash"}), 1, device=True))
    worst = max(m.total_bytes for m in plan(cfg, 1, device=True))
    assert flash < worst
    assert not any("attention" in line for line in advice(cfg, 1, (worst + flash) // 2, device=True))
    assert any("attention" in line for line in advice(cfg, 1, (worst + flash) // 2))


def test_the_planned_state_is_what_a_trainer_allocates(tmp_path):
    """The planner's parameter, gradient and optimizer bytes against a Trainer's buffers (one rank)."""
    from mpi4py import MPI

    from helpers import make_tokens
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    make_tokens(tmp_path / "t.h5")
    cfg = gpt_config(tmp_path / "t.h5", train={"steps": 1})
    planned = plan(cfg, 1)[0]
    mesh = Mesh(comm=MPI.COMM_SELF)
    t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    try:
        r = t.train_step(0, 0.01)
        assert planned.params_bytes == t.params.data.nbytes and planned.grads_bytes == t.grads.data.nbytes
        assert planned.optimizer_bytes == t.optim.slot_bytes
        # the executor's count of the saved activations is the planner's, less the one backward's working set
        assert r["peak_bytes"] <= planned.activation_bytes < r["peak_bytes"] * 1.5
    finally:
        t.close()
        mesh.free()


def test_a_layout_the_world_cannot_hold_is_an_error():
    with pytest.raises(LayoutError):
        plan(gpt_config("t.h5", parallel={"pp": 2}), 3)
    with pytest.raises(ConfigError):
        plan(gpt_config("t.h5", parallel={"tp": 4}), 4)  # n_head 2


def test_advice_names_what_makes_every_rank_fit():
    cfg = config("x.h5", hidden=2048, optim={"name": "adam", "lr": 1e-3}, train={"batch_size": 16})
    ranks = plan(cfg, 4)
    worst = max(m.total_bytes for m in ranks)
    zero2 = max(m.total_bytes for m in plan(config("x.h5", hidden=2048, optim={"name": "adam", "lr": 1e-3},
                                                   train={"batch_size": 16}, parallel={"zero": 2}), 4))
    limit = (worst + zero2) // 2
    said = advice(cfg, 4, limit)
    assert any(line.startswith("--set parallel.zero=2") for line in said)
    assert not any(line.startswith("--set parallel.zero=1:") for line in said) or \
        max(m.total_bytes for m in plan(config("x.h5", hidden=2048, optim={"name": "adam", "lr": 1e-3},
                                               train={"batch_size": 16}, parallel={"zero": 1}), 4)) <= limit
    assert "DOES NOT FIT" in plan_table(ranks, limit)
    # with micro-batches zero = 2 saves no gradient memory at the peak: the advice says the figure of zero = 1
    small_buckets = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, bucket_mb=1))
    for m in (1, 2):
        said = {line.split(":")[0]: line.split(": ")[1] for line in advice(
            dataclasses.replace(small_buckets, train=dataclasses.replace(cfg.train, micro_batches=m)), 4, 10**12)}
        assert (said["--set parallel.zero=2"] == said["--set parallel.zero=1"]) == (m == 2), (m, said)


@pytest.mark.parametrize("text, want", [("5.5GB", 5_500_000_000), ("40GiB", 40 * 2**30), ("512MB", 512_000_000),
                                        ("1e9", 1_000_000_000), ("3 g", 3_000_000_000)])
def test_sizes(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "5.5XB", "lots", "1e300GB", "1e400GB", "infGB", "nanGB"])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="is not a memory size"):
        parse_size(text)


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_the_command_prints_a_table_and_json():
    r = _plan("jobs/configs/gpt-char.toml", "-n", "4", "--set", "parallel.zero=1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].split()[:4] == ["rank", "stage", "dp", "tp"]
    r = _plan("jobs/configs/digits-pp2.toml", "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    ranks = json.loads(r.stdout)["ranks"]
    assert [m["stage"] for m in ranks] == [0, 0, 1, 1]
    assert set(ranks[0]) == {f.name for f in RankMemory.__dataclass_fields__.values()} | {"total_bytes"}


def test_the_command_says_what_does_not_fit():
    r = _plan("jobs/configs/gpt-char.toml", "-n", "2", "--mem-per-rank", "150MB")
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout
    assert "ranks 0, 1 do not fit in 150 MB" in r.stdout
    r = _plan("jobs/configs/gpt-char.toml", "--mem-per-rank", "1KB")  # a limit below one MB is not "0 MB"
    assert "within 1,000 bytes" in r.stdout and "do not fit in 1,000 bytes" in r.stdout, r.stdout


@pytest.mark.parametrize("args, message", [
    (["jobs/configs/gpt-char.toml", "-n", "3", "--set", "parallel.pp=2"], "hpctrain: error: world size 3"),
    (["jobs/configs/gpt-char.toml", "--set", "parallel.zero=5"], "parallel.zero"),
    (["jobs/configs/gpt-char.toml", "-n", "0"], "-n: must be at least 1"),
    (["jobs/configs/gpt-char.toml", "--mem-per-rank", "lots"], "--mem-per-rank: 'lots' is not a memory size"),
    (["no/such.toml"], "hpctrain: error:"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    r = _plan(*args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


@pytest.mark.parametrize("deterministic", [False, True], ids=["plain", "deterministic"])
def test_a_run_reports_the_planned_fields_measured(tmp_path, deterministic):
    """The metrics file's memory lines (after step 1 and at the end) against the plan of the same config;
    ``train.deterministic`` adds the tied head's local replica and the shard tree's parked sums."""
    from mpi4py import MPI

    from helpers import make_tokens
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    make_tokens(tmp_path / "t.h5")
    cfg = gpt_config(tmp_path / "t.h5", train={"steps": 3, "metrics": str(tmp_path / "m.jsonl"),
                                               "deterministic": deterministic})
    lines = []
    mesh = Mesh(comm=MPI.COMM_SELF)
    t = Trainer(cfg, mesh=mesh, log=lines.append)
    try:
        t.run()
    finally:
        t.close()
        mesh.free()
    with open(tmp_path / "m.jsonl") as f:
        memory = [json.loads(line) for line in f if '"memory"' in line]
    assert [m["step"] for m in memory] == [1, 3]
    got, want = memory[-1]["memory"][0], plan(cfg, 1)[0].as_dict()
    for key in ("rank", "stage", "params_bytes", "grads_bytes", "optimizer_bytes", "buffer_bytes", "runtime_bytes"):
        assert got[key] == want[key], key
    if deterministic:  # wte's replica (12 x 8) in params and grads; two parked sums (4 shards, one rank)
        plain = plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, deterministic=False)), 1)[0]
        assert got["params_bytes"] - plain.params_bytes == 4 * 12 * 8
        assert got["buffer_bytes"] - plain.buffer_bytes == 2 * got["grads_bytes"]
    assert 0 < got["activation_bytes"] <= want["activation_bytes"]
    assert got["peak_rss_bytes"] > 50e6
    said = [line for line in lines if line.startswith("memory: peak RSS")]
    assert len(said) == 1 and "on rank 0 (largest of 1)" in said[0]


@pytest.mark.parametrize("backend, gpu, cuda_aware, mpi_says, want", [
    ("auto", True, "auto", False, (True, False)),   # a GPU node: auto trains on it, so it is planned on it
    ("auto", False, "auto", True, (False, False)),  # no GPU: the CPU
    ("cpu", True, True, True, (False, False)),
    ("cuda", True, "auto", True, (True, True)),     # the MPI library says it takes device arrays
    ("cuda", True, False, True, (True, False)),     # parallel.cuda_aware = false wins
])
def test_the_plan_is_for_the_backend_and_mpi_the_run_would_take(monkeypatch, backend, gpu, cuda_aware, mpi_says,
                                                               want):
    import hpctrain.backend
    import hpctrain.parallel.mesh
    from hpctrain.commands.plan import plan_device as _plan_device

    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    monkeypatch.setattr(hpctrain.backend, "cuda_available", lambda: gpu)
    monkeypatch.setattr(hpctrain.parallel.mesh, "mpi_cuda_aware", lambda: mpi_says)
    cfg = config("d.h5", train={"backend": backend}, parallel={"cuda_aware": cuda_aware})
    assert _plan_device(cfg) == want


def test_a_gpu_without_cuda_aware_mpi_plans_the_pinned_staging_of_the_gradients():
    cfg = config("d.h5", parallel={"dp": 2})
    aware, staged = (plan(cfg, 2, device=True, cuda_aware=a) for a in (True, False))
    size = 6 * 8 + 8 + 8 * 8 + 8 + 8 * 3 + 3 + 2 * 8  # tests/helpers.py config: three Linear layers, a LayerNorm
    assert [s.buffer_bytes - a.buffer_bytes for s, a in zip(staged, aware)] == [4 * size] * 2
    assert plan(config("d.h5"), 1, device=True, cuda_aware=False)[0].buffer_bytes == 0  # dp 1: no MPI, no staging


def test_zero_3_plans_the_parameter_chunks_and_two_gathered_units():
    """zero 3: each rank's parameters are its chunks plus the two largest units (parallel/zero3.py's pool);
    gradients and optimizer state as zero 2's. The advice names zero 3 where zero 2 does not fit, and a
    layout zero 3 does not run yet (train.deterministic) is refused; the interleaved schedule is planned."""
    from hpctrain.parallel.zero3 import ParamGather

    cfg = gpt_config("t.h5", model={"n_layer": 8, "n_embd": 128, "n_head": 4, "vocab_size": 64},
                     optim={"name": "adam", "lr": 1e-3}, train={"batch_size": 4})
    two, three = (plan(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=z)), 4)
                  for z in (2, 3))
    n = two[0].params_bytes // 4
    part = make_model(cfg.model).part()
    pool = ParamGather.pool_bytes(part)
    for m2, m3 in zip(two, three):
        assert m3.grads_bytes == m2.grads_bytes and m3.optimizer_bytes == m2.optimizer_bytes
        assert m3.params_bytes == m3.optimizer_bytes // 2 + pool and m3.params_bytes < 4 * n * 0.75
    limit = (max(m.total_bytes for m in two) + max(m.total_bytes for m in three)) // 2
    said = advice(cfg, 4, limit)
    assert any(line.startswith("--set parallel.zero=3") for line in said), said
    assert not any(line.startswith("--set parallel.zero=2:") for line in said), said
    interleaved = dataclasses.replace(cfg.parallel, zero=3, pp=2, schedule="interleaved-1f1b", virtual_stages=2)
    ranks = plan(dataclasses.replace(cfg, parallel=interleaved, train=dataclasses.replace(cfg.train, micro_batches=4)), 4)
    for m in ranks:  # each stage's part (two chunks) pools its own two largest units
        assert m.params_bytes < two[0].params_bytes // 2
    deterministic = dataclasses.replace(cfg.train, deterministic=True)
    with pytest.raises(ConfigError, match="train.deterministic"):
        plan(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=3), train=deterministic), 4)
