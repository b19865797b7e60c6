"""Pipeline parallelism equals single-process training; stages report their peaks; checkpoints move between layouts.

Run under ``mpiexec -n 1``, ``-n 2`` and ``-n 4`` by tests/test_suites.py. A pipeline of P stages
needs P ranks, so the tests skip below that; dp is whatever the world leaves (world / P), and
the global batch grows with it so every rank gets the same share. The single-process reference is
each rank training the same config alone on COMM_SELF with pp = 1.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, copy_checkpoint, train_params as train
from hpctrain.parallel.schedule import check_schedule, make_schedule

quiet = dict(log=lambda *a: None)


def pipeline_sizes(comm):
    """The pipeline depths this world can run (7-layer helper model: 4 partition units)."""
    return sorted({p for p in (2, 4) if comm.size % p == 0})


def cfg_for(path, comm, pp, *, schedule="1f1b", micro=2, optim=None, **sections):
    dp = comm.size // pp if comm.size >= pp else 1
    sections.setdefault("train", {}).update(steps=5, batch_size=8 * dp, micro_batches=micro)
    sections.setdefault("parallel", {}).update(pp=pp, schedule=schedule)
    return config(path, optim=optim or {"name": "sgd", "lr": 0.1, "momentum": 0.9}, data={"shuffle": True},
                  **sections)


def alone(cfg):
    """The same job on one process: pp = 1, no explicit stages."""
    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1, stages=(), dp="auto",
                                                                   schedule="1f1b", virtual_stages=1))
    return train(single, MPI.COMM_SELF)


def assert_close(got, want):
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero-bubble", "zero-bubble-h2"])
@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("optim", [{"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"name": "adamw", "lr": 0.01}],
                         ids=["sgd", "adamw"])
def test_pipeline_equals_single_process(comm, data, schedule, micro, optim):
    if comm.size < 2:
        pytest.skip("needs two ranks for a two-stage pipeline")
    for pp in pipeline_sizes(comm):
        cfg = cfg_for(data, comm, pp, schedule=schedule, micro=micro, optim=optim, train={"grad_clip": 0.5})
        assert_close(train(cfg, comm), alone(cfg))


@pytest.mark.parametrize("micro", [2, 4])
@pytest.mark.parametrize("optim", [{"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"name": "adamw", "lr": 0.01}],
                         ids=["sgd", "adamw"])
def test_interleaved_equals_single_process(comm, data, micro, optim):
    """pp = 2 with two model chunks per stage (the helper model's 4 units: stage 0 runs units 0 and 2, stage 1
    units 1 and 3), any dp the world leaves, clipping on: the parameters of one process."""
    if comm.size < 2 or comm.size % 2:
        pytest.skip("needs an even number of ranks")
    cfg = cfg_for(data, comm, 2, schedule="interleaved-1f1b", micro=micro, optim=optim,
                  train={"grad_clip": 0.5}, parallel={"virtual_stages": 2})
    assert_close(train(cfg, comm), alone(cfg))


def eight_linears(data, comm, pp, tp=1, micro=4):
    """An MLP of 8 Linear layers (tanh between): 8 partition units, or 4 column/row-parallel pairs under tp = 2."""
    layers = []
    for i in range(8):
        layers.append({"type": "linear", "in": 6 if i == 0 else 8, "out": 3 if i == 7 else 8})
        if i < 7:
            layers.append({"type": "tanh"})
    dp = comm.size // (pp * tp)
    return config(data, model={"layers": layers}, optim={"name": "adamw", "lr": 0.01},
                  train={"steps": 4, "batch_size": 8 * dp, "micro_batches": micro, "grad_clip": 0.5},
                  data={"shuffle": True},
                  parallel={"pp": pp, "tp": tp, "schedule": "interleaved-1f1b", "virtual_stages": 2})


def test_interleaved_four_stages_and_with_tensor_parallel_equal_single_process(comm, data):
    """Under ``-n 4``: pp = 4 with two chunks each (8 virtual stages, stage 3's chunk 0 sending to stage 0's
    chunk 1), and pp = 2 × tp = 2 with two chunks each (each chunk one column/row-parallel pair)."""
    if comm.size != 4:
        pytest.skip("needs four ranks")
    cfg = eight_linears(data, comm, 4)
    assert_close(train(cfg, comm), alone(cfg))
    cfg = eight_linears(data, comm, 2, tp=2, micro=2)
    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1))
    assert_close(train(cfg, comm), alone(single))


def test_interleaved_with_explicit_chunks_evaluates_and_checkpoints_as_one_process(comm, data, shared_dir):
    """``parallel.stages`` names the 4 virtual stages; the logged losses and the evaluation equal one process's;
    a checkpoint of the interleaved run resumes on one process, and one of one process resumes interleaved."""
    if comm.size < 2 or comm.size % 2:
        pytest.skip("needs an even number of ranks")
    metrics = f"{shared_dir}/m-{{}}.jsonl"
    base = cfg_for(data, comm, 2, schedule="interleaved-1f1b", micro=2, optim={"name": "adamw", "lr": 0.01},
                   train={"steps": 10, "eval_every": 5, "log_every": 1},
                   parallel={"virtual_stages": 2, "stages": [[0, 1], [2, 3], [4, 5], [6, 6]]})

    def run(cfg, c, name, **checkpoint):
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, metrics=metrics.format(name)),
                                  checkpoint=dataclasses.replace(cfg.checkpoint, **checkpoint))
        return train(cfg, c)

    pipe_dir = f"{shared_dir}/pipe"
    straight = run(base, comm, "pipe", dir=pipe_dir, every=5)
    single = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, pp=1, stages=(), dp="auto",
                                                                     schedule="1f1b", virtual_stages=1))
    assert_close(straight, run(single, MPI.COMM_SELF, f"alone-{comm.rank}"))
    if comm.rank == 0:
        lines = {name: [json.loads(line) for line in open(metrics.format(name))] for name in ("pipe", "alone-0")}
        for key in ("loss", "val_loss", "val_accuracy"):
            got = [r[key] for r in lines["pipe"] if key in r]
            want = [r[key] for r in lines["alone-0"] if key in r]
            assert got and np.allclose(got, want, rtol=1e-5), key
    comm.Barrier()
    mine = f"{shared_dir}/alone-ck-{comm.rank}"
    os.makedirs(mine)
    copy_checkpoint(f"{pipe_dir}/ckpt-00000005.h5", mine)
    assert_close(run(single, MPI.COMM_SELF, f"resumed-{comm.rank}", dir=mine), straight)
    solo = f"{shared_dir}/solo-{comm.rank}"
    run(single, MPI.COMM_SELF, f"solo-{comm.rank}", dir=solo, every=5)
    resumed = run(base, comm, "pipe2", dir=f"{shared_dir}/pipe2", resume=f"{shared_dir}/solo-0/ckpt-00000005.h5")
    assert_close(resumed, straight)


def test_explicit_stages_equal_single_process(comm, data):
    if comm.size < 2 or comm.size % 2:
        pytest.skip("needs an even number of ranks")
    # layers: 0 linear, 1 tanh, 2 layernorm, 3 gelu, 4 linear, 5 relu, 6 linear: cut inside a unit on purpose
    cfg = cfg_for(data, comm, 2, parallel={"stages": [[0, 4], [5, 6]]})
    assert_close(train(cfg, comm), alone(cfg))


def test_evaluation_and_loss_match_single_process(comm, data, shared_dir):
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    if comm.size < 2 or comm.size % 2:
        pytest.skip("needs an even number of ranks")
    metrics = f"{shared_dir}/m-{{}}.jsonl"
    cfg = cfg_for(data, comm, 2, micro=4, train={"eval_every": 2, "log_every": 1})
    results = {}
    for name, c, p in (("pipe", comm, cfg.parallel), ("alone", MPI.COMM_SELF, None)):
        run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, metrics=metrics.format(
            name if name == "pipe" else f"alone-{comm.rank}")))
        if p is None:
            run_cfg = dataclasses.replace(run_cfg, parallel=dataclasses.replace(cfg.parallel, pp=1))
        mesh = Mesh(comm=c, pp=run_cfg.parallel.pp)
        t = Trainer(run_cfg, mesh=mesh, **quiet)
        results[name] = t.run()
        t.close()
        mesh.free()
    if comm.rank == 0:
        assert results["pipe"]["val_accuracy"] == pytest.approx(results["alone"]["val_accuracy"])
        assert results["pipe"]["val_loss"] == pytest.approx(results["alone"]["val_loss"], rel=1e-5)
        pipe = [json.loads(line) for line in open(metrics.format("pipe"))]
        single = [json.loads(line) for line in open(metrics.format("alone-0"))]
        assert [r["step"] for r in pipe] == [r["step"] for r in single]
        for a, b in zip(pipe, single):
            for key in ("loss", "val_loss", "grad_norm"):
                if key in b:
                    assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a["step"])
        stages = [r["stages"] for r in pipe if "stages" in r]
        assert stages and all(len(s) == 2 for s in stages)
        assert "stages" not in single[0]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero-bubble", "zero-bubble-h2"])
def test_stages_report_their_peak_of_live_micro_batches(comm, data, shared_dir, schedule):
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    if comm.size < 2:
        pytest.skip("needs two ranks")
    micro = 4
    for pp in pipeline_sizes(comm):
        path = f"{shared_dir}/peaks-{schedule}-{pp}.jsonl"
        cfg = cfg_for(data, comm, pp, schedule=schedule, micro=micro,
                      train={"metrics": path, "log_every": 5, "eval_every": 5})
        mesh = Mesh(comm=comm, pp=pp)
        t = Trainer(cfg, mesh=mesh, **quiet)
        t.run()
        # each receive buffer holds one micro-batch (8 samples a rank / 4), not the rank's whole share, and
        # evaluation, which ran through the same rings, went in chunks of that size
        rings = t.runner.executor.rings()
        assert rings and all(a.shape[0] == 8 // micro for ring in rings for a in ring.arrays)
        t.close()
        mesh.free()
        if comm.rank == 0:
            last = [r for r in map(json.loads, open(path)) if "stages" in r][-1]
            peaks = [s["peak_micro_batches"] for s in last["stages"]]
            # zero-bubble: a micro-batch is live until its W, one more in flight than 1F1B's (parallel/schedule.py)
            want = [micro] * pp if schedule == "gpipe" else [min(pp - s, micro) for s in range(pp)] \
                if schedule == "1f1b" else [min(pp - s + 1, micro) for s in range(pp)] \
                if schedule == "zero-bubble" else list(check_schedule(make_schedule(schedule, pp, micro)).peak_live)
            assert peaks == want
            assert all(s["peak_activation_bytes"] > 0 for s in last["stages"])
            assert all(0.0 <= s["bubble"] < 1.0 for s in last["stages"])


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_trace_has_one_track_per_rank(comm, data, shared_dir, schedule):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    path = f"{shared_dir}/trace-{schedule}.json"
    cfg = cfg_for(data, comm, 2, schedule=schedule, micro=2, train={"trace": path, "steps": 2})
    train(cfg, comm)
    if comm.rank == 0:
        events = json.load(open(path))["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        assert {e["tid"] for e in spans} == set(range(comm.size))
        kinds = {e["cat"] for e in spans}
        backward = {"backward"} if schedule == "1f1b" else {"backward input", "backward weight"}
        assert {"forward", "send activation", "recv activation", "send grad", "recv grad",
                "optimizer"} | backward <= kinds
        if comm.size > 2:
            assert "allreduce" in kinds
        names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert "rank 0 (stage 0, dp 0, tp 0)" in names


def test_pipeline_checkpoint_resumes_on_one_process_and_back(comm, data, shared_dir):
    if comm.size < 2 or comm.size % 2:
        pytest.skip("needs an even number of ranks")
    base = cfg_for(data, comm, 2, optim={"name": "adamw", "lr": 0.01}, train={"steps": 10})

    def with_checkpoint(cfg, **checkpoint):
        return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **checkpoint))

    pipe_dir = f"{shared_dir}/pipe"
    straight = train(with_checkpoint(base, dir=pipe_dir, every=5), comm)
    # the pp = 2 checkpoint resumes on one process (pp = 1)
    mine = f"{shared_dir}/alone-{comm.rank}"
    os.makedirs(mine)
    copy_checkpoint(f"{pipe_dir}/ckpt-00000005.h5", mine)
    single = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, pp=1))
    assert_close(train(with_checkpoint(single, dir=mine), MPI.COMM_SELF), straight)
    # a pp = 1 checkpoint resumes on the pipeline
    solo = f"{shared_dir}/solo-{comm.rank}"
    train(with_checkpoint(single, dir=solo, every=5), MPI.COMM_SELF)
    resumed = train(with_checkpoint(base, dir=f"{shared_dir}/pipe2", resume=f"{shared_dir}/solo-0/ckpt-00000005.h5"),
                    comm)
    assert_close(resumed, straight)


def test_the_schedule_is_checked_once_on_rank_0_and_shared(comm, data, monkeypatch):
    """Every rank builds its instructions; only world rank 0 simulates the schedule, once per shape per process,
    and a fault it finds stops every rank with its message."""
    from hpctrain.parallel import schedule as sched
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer
    from hpctrain.train.step import agreed_schedule

    if comm.size < 2:
        pytest.skip("needs two ranks")
    calls = []
    real = sched.check_schedule
    monkeypatch.setattr(sched, "check_schedule", lambda s: calls.append(s.name) or real(s))
    sched.checked.cache_clear()
    cfg = cfg_for(data, comm, 2, micro=4)
    for _ in range(2):  # the second Trainer of the same shape checks nothing again
        mesh = Mesh(comm=comm, pp=2)
        t = Trainer(cfg, mesh=mesh, **quiet)
        assert len(t.runner.stats.peak_live) == 2 and t.runner.schedule.micro_batches == 4
        t.close()
        mesh.free()
    counts = comm.allgather(len(calls))
    assert counts == [1] + [0] * (comm.size - 1)

    def faulty(name, p, m, v=1):
        raise sched.ScheduleError(f"schedule {name!r}: stage 1 deadlocks")

    monkeypatch.setattr(sched, "checked", faulty)
    monkeypatch.setattr("hpctrain.train.step.checked", faulty)
    with pytest.raises(sched.ScheduleError, match="^schedule 'gpipe': stage 1 deadlocks$"):
        agreed_schedule(comm, "gpipe", 2, 4)
