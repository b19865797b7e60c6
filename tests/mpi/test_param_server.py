"""The asynchronous parameter server: staleness 0 is synchronous data parallelism, staleness 2 still learns and
keeps its bound, checkpoints move between async and sync mode.

Run under ``mpiexec -n 2, 3, 4`` by tests/test_suites.py (1 server and the rest workers, or 2 + 2 at four
ranks); one rank cannot serve and work, so the tests skip there. The reference is the same job trained
synchronously on one process with the same global batch.
"""

import dataclasses
import os
import time

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, gpt_config, train_params as train
from hpctrain.config import load_config
from hpctrain.parallel.param_server import SNAPSHOTS
from hpctrain.train.async_ps import AsyncTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


def servers(comm):
    return 2 if comm.size == 4 else 1


def run_async(cfg):
    trainer = AsyncTrainer(cfg, log=lambda *a: None)
    try:
        return trainer.run()
    finally:
        trainer.close()


def checkpoint_params(folder):
    name = sorted(n for n in os.listdir(folder) if n.startswith("ckpt-"))[-1]
    with h5py.File(os.path.join(folder, name), "r") as f:
        return {k: f["params"][k][()] for k in f["params"]}, int(f.attrs["step"])


def alone(cfg):
    sync = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mode="sync"),
                               checkpoint=dataclasses.replace(cfg.checkpoint, dir=""))
    return train(sync, MPI.COMM_SELF)


def agreed(comm, worst):
    """Rank 0's figure on every rank (a failing assert on one rank alone could hang the next test)."""
    buf = np.array([worst], dtype=np.float64)
    comm.Bcast(buf, root=0)
    return float(buf[0])


def test_staleness_zero_is_synchronous_data_parallel_training(comm, data, shared_dir):
    if comm.size < 2:
        pytest.skip("a server and a worker need two ranks")
    S = servers(comm)
    W = comm.size - S
    cfg = config(data, optim=SGD, train={"steps": 5, "batch_size": 4 * W, "grad_clip": 0.5, "micro_batches": 2},
                 parallel={"mode": "async_ps", "servers": S, "staleness": 0}, checkpoint={"dir": f"{shared_dir}/ck"})
    summary = run_async(cfg)
    worst = 1.0
    if comm.rank == 0:
        got, step = checkpoint_params(f"{shared_dir}/ck")
        want = alone(cfg)
        worst = max(float(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max()) for n in want)
        assert step == 5 and summary["updates"] == 5 and summary["update_lag_max"] == 0
        # each server wrote its own range, nothing went through rank 0, and the set verifies
        from hpctrain.checkpoint import inspect

        (shards,) = [n for n in os.listdir(f"{shared_dir}/ck") if n.endswith(".shards")]
        assert sorted(os.listdir(f"{shared_dir}/ck/{shards}")) == [f"rank-{r:05d}.h5" for r in range(S)]
        text, ok = inspect(f"{shared_dir}/ck/ckpt-00000005.h5")
        assert ok, text
    assert agreed(comm, worst) < 1e-6


def test_staleness_zero_with_dropout_draws_the_synchronous_runs_masks(comm, tokens, shared_dir):
    """A worker's samples draw their dropout masks by their place in the step's global batch, as under sync."""
    if comm.size < 2:
        pytest.skip("a server and a worker need two ranks")
    S = servers(comm)
    W = comm.size - S
    cfg = gpt_config(tokens, optim=SGD, model={"dropout": 0.2},
                     train={"steps": 3, "batch_size": 2 * W, "grad_clip": 0.5, "micro_batches": 2},
                     parallel={"mode": "async_ps", "servers": S, "staleness": 0},
                     checkpoint={"dir": f"{shared_dir}/ck-gpt"})
    run_async(cfg)
    worst = 1.0
    if comm.rank == 0:
        got, _ = checkpoint_params(f"{shared_dir}/ck-gpt")
        want = alone(cfg)
        worst = max(float(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max()) for n in want)
    assert agreed(comm, worst) < 1e-6


def test_staleness_two_learns_the_digits_within_its_bound(comm, shared_dir):
    if comm.size < 2:
        pytest.skip("a server and a worker need two ranks")
    S = servers(comm)
    cfg = load_config(os.path.join(ROOT, "jobs/configs/digits-ps.toml"),
                      [f"parallel.servers={S}", "parallel.staleness=2", f"train.metrics={shared_dir}/m.jsonl",
                       f"checkpoint.dir={shared_dir}/ck", "train.backend=\"cpu\""])
    summary = run_async(cfg)
    accuracy = np.array([summary.get("val_accuracy", 0.0), summary.get("steps_ahead_max", 99)])
    comm.Bcast(accuracy, root=0)
    assert accuracy[0] >= 0.95 and accuracy[1] <= 2
    if comm.rank == 0:
        assert sum(summary["updates_per_worker"]) == 600 * (comm.size - S) and summary["step"] == 600
        assert len(summary["worker_idle_s"]) == comm.size - S and summary["server_updates_per_s"] > 0


def _say_progress(folder, monkeypatch):
    """Have this worker write the gradients it has pushed to ``folder``/pushed-RANK after each push, and
    ``done`` there once the servers have told it to stop."""
    import hpctrain.parallel.param_server as ps

    path = os.path.join(folder, f"pushed-{MPI.COMM_WORLD.rank}")
    pushed = [0]

    def write(text):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

    def push(self, *args, **kwargs):
        ps_push(self, *args, **kwargs)
        pushed[0] += 1
        write(str(pushed[0]))

    def done(self, steps):
        write("done")
        ps_done(self, steps)

    ps_push, ps_done = ps.WorkerLink.push, ps.WorkerLink.done
    monkeypatch.setattr(ps.WorkerLink, "push", push)
    monkeypatch.setattr(ps.WorkerLink, "done", done)


def _lag_behind(folder, others, monkeypatch):
    """Make this worker a straggler by counting, not by the clock: before asking for its (n + 1)-th step it
    waits until every other worker has pushed n + 2 gradients, or has been told to stop (the budget is
    spent: its last request is refused). Each step it takes, the others have already taken more."""
    import hpctrain.parallel.param_server as ps

    def ahead(rank, n):
        try:
            with open(os.path.join(folder, f"pushed-{rank}")) as f:
                text = f.read()
        except FileNotFoundError:
            return False
        return text == "done" or int(text) >= n + 2

    def request(self, clock, into, stop):
        deadline = time.monotonic() + 300  # ends a broken test; never reached by a working one
        while not all(ahead(rank, clock) for rank in others):
            assert time.monotonic() < deadline, "the other workers made no progress"
            time.sleep(0.001)
        ps_request(self, clock, into, stop)

    ps_request = ps.WorkerLink.request
    monkeypatch.setattr(ps.WorkerLink, "request", request)


def test_the_step_budget_is_global_so_a_straggler_takes_fewer_steps(comm, data, shared_dir, monkeypatch):
    """With a loose bound the fast workers take the straggler's share of the budget; the bound still holds.
    The first worker lags by a count of the others' steps, not by a pause: on a loaded machine a pause
    need not make it the slowest."""
    S = servers(comm)
    W = comm.size - S
    if W < 2:
        pytest.skip("a straggler needs another worker beside it")
    k, steps = 8, 30
    if comm.rank == S:
        _lag_behind(shared_dir, range(S + 1, comm.size), monkeypatch)
    elif comm.rank > S:
        _say_progress(shared_dir, monkeypatch)
    cfg = config(data, optim=SGD, train={"steps": steps, "batch_size": 4 * W},
                 parallel={"mode": "async_ps", "servers": S, "staleness": k}, checkpoint={"dir": f"{shared_dir}/ck"})
    summary = run_async(cfg)
    per = np.zeros(W + 3, dtype=np.int64)
    if comm.rank == 0:
        per[:W] = summary["updates_per_worker"]
        per[W:] = summary["step"], summary["steps_ahead_max"], summary["server_snapshots_max"]
    comm.Bcast(per, root=0)
    counts, step, ahead, snapshots = per[:W], per[W], per[W + 1], per[W + 2]
    assert counts.sum() == steps * W and step == steps and ahead <= k, per
    assert 1 <= snapshots <= SNAPSHOTS, per  # the server's copies of its range: bounded by neither W nor k
    assert counts[0] < counts[1:].min() and counts.max() - counts.min() <= k + 1, per


def test_no_server_refuses_a_pull_the_first_server_granted(comm, data, shared_dir, monkeypatch):
    """Two servers: the first grants the budget's last gradient to worker A, whose PULL reaches the second
    server late; worker B, told to stop meanwhile, sends DONE. The second server must still grant A's pull
    (refusing it lost that gradient: the run ended one step short). A is slowed between its two PULLs."""
    S = servers(comm)
    W = comm.size - S
    if S < 2:
        pytest.skip("needs two servers (four ranks)")
    import hpctrain.parallel.param_server as ps
    from hpctrain.parallel.executor import StageExecutor

    if comm.rank == S:  # worker A: a pause between its PULL to the first server and to the second
        def request(self, clock, into, stop):
            self._wait_sends()
            head = np.array([clock, int(stop)], dtype=np.int64)
            for s in range(self.S):
                self.world.Send(head, dest=s, tag=ps.TAGS["PULL"])
                time.sleep(0.02 if s == 0 else 0)
            for s, (lo, hi) in enumerate(self.ranges):
                self._recvs.append(self.world.Irecv(self._versions[s], source=s, tag=ps.TAGS["VERSION"]))
                self._recvs.append(self.world.Irecv(into[lo:hi], source=s, tag=ps.TAGS["PARAMS"]))

        monkeypatch.setattr(ps.WorkerLink, "request", request)
    if comm.rank == S + 1:  # worker B: a little slower, so that it is told to stop while A is between PULLs
        original = StageExecutor.run

        def slow(self, *args, **kwargs):
            time.sleep(0.005)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(StageExecutor, "run", slow)
    steps = 30
    results = np.zeros((3, 2), dtype=np.int64)
    for attempt in range(3):  # the race needs the timing: three chances to hit it
        cfg = config(data, optim=SGD, train={"steps": steps, "batch_size": 4 * W},
                     parallel={"mode": "async_ps", "servers": S, "staleness": 100},
                     checkpoint={"dir": f"{shared_dir}/ck{attempt}"})
        summary = run_async(cfg)
        if comm.rank == 0:
            results[attempt] = summary["step"], sum(summary["updates_per_worker"])
    comm.Bcast(results, root=0)
    assert (results == [steps, steps * W]).all(), results


@pytest.mark.parametrize("first", ["async_ps", "sync"])
def test_checkpoints_move_between_async_and_sync_mode(comm, data, shared_dir, first):
    """Two steps in one mode, a checkpoint, two more in the other == four synchronous steps (staleness 0)."""
    if comm.size < 2:
        pytest.skip("a server and a worker need two ranks")
    S = servers(comm)
    W = comm.size - S
    ck = f"{shared_dir}/ck-{first}"
    base = config(data, optim={"name": "adamw", "lr": 0.01}, train={"steps": 2, "batch_size": 12 * W},  # W and world
                  parallel={"servers": S, "staleness": 0}, checkpoint={"dir": ck})

    def at(mode, steps):
        return dataclasses.replace(base, train=dataclasses.replace(base.train, steps=steps),
                                   parallel=dataclasses.replace(base.parallel, mode=mode))

    other = "sync" if first == "async_ps" else "async_ps"
    for mode, steps in ((first, 2), (other, 4)):
        if mode == "async_ps":
            run_async(at(mode, steps))
        else:
            train(at(mode, steps), comm)
    worst = 1.0
    if comm.rank == 0:
        got, step = checkpoint_params(ck)
        want = alone(at("sync", 4))
        worst = max(float(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max()) for n in want) if step == 4 else 1
    assert agreed(comm, worst) < 1e-4  # AdamW amplifies rounding (tests/mpi/test_gpt_parallel.py)


@pytest.mark.parametrize("staleness", [0, 2])
def test_checkpoint_every_writes_between_updates_and_resumes(comm, data, shared_dir, staleness):
    """checkpoint.every: the servers alone write a checkpoint every `every` steps while the workers go on (they
    were ignored: a crashed async run lost everything); the end's is written once; a run resumes from one.
    At staleness 0 the step-4 checkpoint is exactly the synchronous run's after 4 steps."""
    if comm.size < 2:
        pytest.skip("a server and a worker need two ranks")
    S = servers(comm)
    W = comm.size - S
    ck = f"{shared_dir}/ck-every-{staleness}"
    cfg = config(data, optim=SGD, train={"steps": 6, "batch_size": 4 * W},
                 parallel={"mode": "async_ps", "servers": S, "staleness": staleness},
                 checkpoint={"dir": ck, "every": 2, "keep": 10})
    run_async(cfg)
    problem = None
    if comm.rank == 0:
        names = sorted(n for n in os.listdir(ck) if n.endswith(".h5"))
        if names != ["ckpt-00000002.h5", "ckpt-00000004.h5", "ckpt-00000006.h5"]:
            problem = f"checkpoints {names}"
        elif staleness == 0:
            with h5py.File(f"{ck}/ckpt-00000004.h5", "r") as f:
                got = {k: f["params"][k][()] for k in f["params"]}
            short = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4))
            want = alone(short)
            worst = max(float(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max()) for n in want)
            problem = None if worst < 1e-6 else f"step 4 differs from the synchronous run by {worst}"
    problem = comm.bcast(problem, root=0)
    assert problem is None, problem
    # a later run resumes from the newest (step 6) and trains to 8
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))
    summary = run_async(longer)
    if comm.rank == 0:
        assert summary["step"] == 8 and summary["updates_per_worker"] and sum(summary["updates_per_worker"]) == 2 * W


def test_a_finished_run_resumed_again_writes_nothing(comm, data, shared_dir):
    """At or past train.steps the parameter server, like the synchronous trainer, says so and evaluates, and
    writes neither a checkpoint nor a metrics line."""
    if comm.size < 2:
        pytest.skip("a server and a worker need two ranks")
    S = servers(comm)
    W = comm.size - S
    ck = f"{shared_dir}/ck-finished"
    cfg = config(data, optim=SGD, train={"steps": 2, "batch_size": 4 * W, "metrics": f"{shared_dir}/finished.jsonl"},
                 parallel={"mode": "async_ps", "servers": S}, checkpoint={"dir": ck})
    run_async(cfg)
    comm.Barrier()

    def written():
        with open(f"{shared_dir}/finished.jsonl") as f:
            return sorted(os.listdir(ck)), f.read()

    before = written() if comm.rank == 0 else None
    lines = []
    trainer = AsyncTrainer(cfg, log=lines.append)
    try:
        trainer.run()
    finally:
        trainer.close()
    problem = None
    if comm.rank == 0:
        if written() != before:
            problem = f"a finished run wrote: {before[0]} -> {written()[0]}"
        elif not any("training already finished" in line for line in lines):
            problem = f"no 'already finished' line: {lines}"
    problem = comm.bcast(problem, root=0)
    assert problem is None, problem
