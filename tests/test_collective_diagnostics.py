"""Collective diagnostics (parallel/watch.py): fingerprints name ranks that call different collectives,
the watchdog ends a job stuck in one or with a stopped rank. Each job runs under mpiexec, bounded in time.

The faults are injected into rank 1 by a wrapper script around the CLI: at step 3 it calls a Bcast where
rank 0 calls the stop-signal Allreduce (``different``), skips that Allreduce (``skip``: rank 1 runs into
the next step's gradient Allreduce over another communicator, and both wait for ever), or stops itself
with SIGSTOP (``stop``).
"""

import os
import shutil
import subprocess
import sys
import time

import pytest

from helpers import make_classification, toml_job
from launch import hpctrain_lines, launcher_env, mpi_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")

SCRIPT = """
import os, signal, sys
from mpi4py import MPI
import hpctrain.train.stop as stop
from hpctrain.cli import main

fault = sys.argv[2]
original = stop.StopFlag.any_rank
calls = [0]
def any_rank(self, comm):
    calls[0] += 1
    if MPI.COMM_WORLD.rank == 1 and calls[0] == 4:  # the check after step 3
        if fault == "different":
            import numpy as np
            comm.Bcast(np.zeros(1, dtype=np.int32), root=0)
            return False
        if fault == "skip":
            return False
        if fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault == "sleep":  # stuck in its own code (a hung read, an endless loop): heartbeats go on
            import time
            time.sleep(120)
        if fault == "raise":
            from hpctrain.errors import DataError
            raise DataError("injected: the data went away")
    return original(self, comm)
stop.StopFlag.any_rank = any_rank
sys.exit(main(["train", sys.argv[1]] + sys.argv[3:]))
"""


def run_job(tmp_path, fault, *overrides, timeout=90):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 20, "log_every": 5}))
    env = launcher_env({"PYTHONPATH": ROOT})
    args = [a for o in overrides for a in ("--set", o)]
    t0 = time.monotonic()
    proc = subprocess.run(mpi_command(MPIEXEC, 2, sys.executable, "-c", SCRIPT, str(tmp_path / "job.toml"), fault, *args),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def error_lines(proc):
    """The job's stderr less its launcher's report (tests/launch.py): the error must be all hpctrain said."""
    return hpctrain_lines(proc.stderr)


def test_a_healthy_job_with_both_diagnostics_on_trains_as_without(tmp_path):
    """Fingerprints and the watchdog on, pipeline messages included: no false alarm, the same losses."""
    losses = {}
    for diagnostics in ([], ["train.debug_collectives=true", "train.collective_timeout=30"]):
        proc, _ = run_job(tmp_path, "none", "parallel.pp=2", "train.micro_batches=2", *diagnostics)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[bool(diagnostics)] = [line.split("loss ")[1].split()[0] for line in proc.stdout.splitlines()
                                     if line.startswith("step ")]
    assert losses[True] == losses[False] and len(losses[True]) == 4


def test_a_rank_calling_another_collective_is_named_by_the_fingerprints(tmp_path):
    proc, took = run_job(tmp_path, "different", "train.debug_collectives=true")
    lines = error_lines(proc)
    assert proc.returncode != 0 and took < 60 and len(lines) == 1, proc.stderr[-3000:]
    assert "[rank 0/2]: debug_collectives: the ranks of world called different collectives" in lines[0]
    assert "rank 0: Allreduce #" in lines[0] and "(any_rank)" in lines[0], lines[0]
    assert "rank 1: Bcast #" in lines[0] and "int32x1" in lines[0], lines[0]


def test_a_rank_that_skips_a_collective_is_ended_by_the_timeout(tmp_path):
    proc, took = run_job(tmp_path, "skip", "train.collective_timeout=3")
    lines = error_lines(proc)
    assert proc.returncode != 0 and took < 60 and len(lines) == 1, proc.stderr[-3000:]
    assert "collective_timeout = 3 s: the job is stuck" in lines[0]
    assert "rank 0: step 3, in Allreduce #" in lines[0] and "over world" in lines[0], lines[0]
    assert "rank 1: step 4, in " in lines[0] and "over dp" in lines[0], lines[0]


def test_a_stopped_rank_is_named_by_the_watchdog(tmp_path):
    proc, took = run_job(tmp_path, "stop", "train.collective_timeout=3")
    lines = error_lines(proc)
    assert proc.returncode != 0 and took < 60 and len(lines) == 1, proc.stderr[-3000:]
    assert "rank 1 sent nothing for" in lines[0] and "(stopped or frozen)" in lines[0], lines[0]
    assert "rank 0: step 3, in Allreduce #" in lines[0], lines[0]


def test_a_rank_stuck_outside_mpi_is_named_first_as_what_the_others_wait_for(tmp_path):
    proc, took = run_job(tmp_path, "sleep", "train.collective_timeout=3")
    lines = error_lines(proc)
    assert proc.returncode != 0 and took < 60 and len(lines) == 1, proc.stderr[-3000:]
    stuck = lines[0].split("the job is stuck: ", 1)[1]
    assert stuck.startswith("rank 1 is outside MPI while the others wait for it: step 3, in no MPI call"), lines[0]
    assert "; rank 0: step 3, in Allreduce #" in stuck, lines[0]


def test_with_the_watchdog_on_an_error_on_one_rank_is_still_its_own_one_line(tmp_path):
    """The failing rank's clean-up must not wait for the others (it did: a Barrier in the watchdog's close),
    or the watchdog names it "stopped or frozen" and its own message is lost."""
    proc, took = run_job(tmp_path, "raise", "train.collective_timeout=20")
    lines = error_lines(proc)
    assert proc.returncode == 2 and took < 15 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == "hpctrain: error [rank 1/2]: injected: the data went away", lines


def test_the_callers_mesh_is_left_as_it_was(tmp_path):
    from mpi4py import MPI

    from helpers import config
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.parallel.watch import WatchedComm
    from hpctrain.train import Trainer

    make_classification(tmp_path / "d.h5", n=64)
    mesh = Mesh(comm=MPI.COMM_SELF)
    try:
        trainer = Trainer(config(tmp_path / "d.h5", train={"steps": 2, "debug_collectives": True}), mesh=mesh,
                          log=lambda *a: None)
        trainer.run()
        assert isinstance(trainer.mesh.world, WatchedComm) and not isinstance(mesh.world, WatchedComm)
        trainer.close()
    finally:
        mesh.free()
