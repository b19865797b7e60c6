"""Stop signals on a 2-rank job under the mpiexec on PATH (MPICH's, from the ``[mpich]`` extra) and again
under Open MPI's mpirun (unless the mpiexec on PATH is Open MPI's already): nothing lost to a second signal.

A first SIGTERM stops the run at the next step boundary with a checkpoint; a second SIGTERM (or a Ctrl-C's
SIGINT) while that checkpoint is written is recorded and ignored, on every rank, until world rank 0's
write is durable. A SIGTERM during start-up, before the Trainer exists, stops the job at step 0 with a
checkpoint. MPICH's mpiexec forwards the signals to its ranks; Open MPI's mpirun kills its ranks on
SIGTERM, so there the signals go to the ranks themselves, as Slurm sends them to every task.
"""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import folder_listing, make_classification, toml_job
from launch import launcher_env, launcher_kind, mpi_command, open_mpi_python_for_a_rerun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# each rank writes its pid once MPI is up, before the config is read and the Trainer built (and, when the marks
# say "hold", waits there until its stop handler has run); world rank 0's checkpoint commit (its index) is
# slowed down so that the second signal lands inside it
SCRIPT = """
import os, sys, time
import hpctrain.checkpoint.sharded as sharded
import hpctrain.cli as cli
import hpctrain.commands.jobs as jobs
import hpctrain.train.stop as stop

marks = sys.argv[2]
received = []
handle = stop.StopFlag._handle
def handle_and_note(self, signum, frame):
    received.append(signum)
    return handle(self, signum, frame)
stop.StopFlag._handle = handle_and_note
load_mpi = jobs.load_mpi
def load_mpi_and_say():  # MPI is up, nothing of the Trainer yet
    MPI = load_mpi()
    mark = os.path.join(marks, f"pid{MPI.COMM_WORLD.Get_rank()}")
    with open(mark + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(mark + ".tmp", mark)  # whole or absent: the test reads it as soon as it exists
    t0 = time.monotonic()
    while os.path.exists(os.path.join(marks, "hold")) and not received and time.monotonic() - t0 < 60:
        time.sleep(0.01)  # the start-up signal lands here, however late the test sends it
    return MPI
jobs.load_mpi = load_mpi_and_say
commit = sharded.write_index
def slow_commit(*args, **kwargs):
    open(os.path.join(marks, "writing"), "w").close()
    time.sleep(2.0)
    return commit(*args, **kwargs)
sharded.write_index = slow_commit
sys.exit(cli.main(["train", sys.argv[1]]))
"""


def _launchers():
    return [pytest.param("path", marks=pytest.mark.skipif(shutil.which("mpiexec") is None,
                                                          reason="mpiexec not found (pip install hpctrain[mpich])")),
            "openmpi"]


def _start(tmp_path, mpi, *, hold=False):
    """Start SCRIPT's job under ``mpi`` ("path": the mpiexec on PATH; "openmpi": the Open MPI environment's
    mpirun); (the launcher's process, the folder of the ranks' pids, its output lines so far, its MPI). With
    ``hold``, each rank waits after writing its pid until it has received a stop signal (at most 60 s)."""
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 10_000_000, "log_every": 1},
                                                checkpoint={"dir": "ck"}))
    marks = tmp_path / "marks"
    marks.mkdir()
    if hold:
        (marks / "hold").touch()
    if mpi == "path":
        python, launcher = sys.executable, shutil.which("mpiexec")
    else:
        python = open_mpi_python_for_a_rerun()
        launcher = os.path.join(os.path.dirname(python), "mpirun")
    env = launcher_env({"PYTHONPATH": ROOT})
    env.pop("PYTHONUNBUFFERED", None)  # as in a user's shell: the log lines must still arrive
    proc = subprocess.Popen(mpi_command(launcher, 2, python, "-c", SCRIPT, str(tmp_path / "job.toml"), str(marks)),
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, marks, lines, launcher_kind(launcher)


def _wait_for(what, deadline=60.0):
    t0 = time.monotonic()
    while not what():
        if time.monotonic() - t0 > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def _signal(proc, marks, kind, sig, *, to_ranks=False):
    """What Slurm or a user does: MPICH's launcher forwards to the ranks; under Open MPI, signal the ranks
    (``to_ranks``: the ranks themselves under either)."""
    if kind == "mpich" and not to_ranks:
        proc.send_signal(sig)
        return
    for rank in (0, 1):
        os.kill(int((marks / f"pid{rank}").read_text()), sig)


def _finish(proc, lines):
    try:
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)  # the reader thread's last lines
    return "".join(lines)


@pytest.mark.parametrize("mpi", _launchers())
@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_a_second_signal_during_the_stop_checkpoint_loses_nothing(tmp_path, mpi, second):
    proc, marks, lines, kind = _start(tmp_path, mpi)
    try:
        _wait_for(lambda: any("step " in line for line in lines) and (marks / "pid1").exists())
        _signal(proc, marks, kind, signal.SIGTERM)
        _wait_for(lambda: (marks / "writing").exists())
        time.sleep(0.3)
        _signal(proc, marks, kind, getattr(signal, second))
    finally:
        out = _finish(proc, lines)
    assert proc.returncode == 0, out[-3000:]
    assert "signal SIGTERM received: stopping at step" in out
    names = folder_listing(tmp_path / "ck")  # the checkpoint (its index and shards); no temp, no lock
    assert len(names) == 2 and names[0].endswith(".h5") and names[1] == names[0][:-3] + ".shards", names


@pytest.mark.parametrize("mpi", _launchers())
def test_signals_while_the_ranks_exit_after_the_stop_checkpoint_are_not_fatal(tmp_path, mpi):
    """Python's finalization puts the default action back on a signal with a Python handler: SIGTERM killed a
    rank that had written its checkpoint and was exiting (exit status 15 or 143 for a finished job).

    The signals after the first go to the ranks themselves under MPICH too: its mpiexec, forwarding one to a
    proxy that has just exited with its ranks, fails on its own (exit 255, "unable to send signal downstream")."""
    proc, marks, lines, kind = _start(tmp_path, mpi)
    try:
        _wait_for(lambda: any("step " in line for line in lines) and (marks / "pid1").exists())
        _signal(proc, marks, kind, signal.SIGTERM)
        _wait_for(lambda: any(" written" in line for line in lines) or proc.poll() is not None, deadline=90)
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < 60:  # every 10 ms until the job is gone
            try:
                _signal(proc, marks, kind, signal.SIGTERM, to_ranks=True)
            except ProcessLookupError:  # a rank already gone
                pass
            time.sleep(0.01)
    finally:
        out = _finish(proc, lines)
    assert proc.returncode == 0, out[-3000:]
    assert len(folder_listing(tmp_path / "ck")) == 2


@pytest.mark.parametrize("mpi", _launchers())
def test_a_signal_during_start_up_stops_the_job_at_step_0_with_a_checkpoint(tmp_path, mpi):
    proc, marks, lines, kind = _start(tmp_path, mpi, hold=True)
    try:
        _wait_for(lambda: (marks / "pid0").exists() and (marks / "pid1").exists())
        _signal(proc, marks, kind, signal.SIGTERM)
    finally:
        out = _finish(proc, lines)
    assert proc.returncode == 0, out[-3000:]
    assert "received during start-up: stopping at step 0" in out
    assert folder_listing(tmp_path / "ck") == ["ckpt-00000000.h5", "ckpt-00000000.shards"]
