"""Progress: an ETA in every log line; on a terminal a status line between the log lines, never in a file."""

import io
import os
import pty
import select
import subprocess
import sys

import pytest

from helpers import make_classification, toml_job
from hpctrain.errors import ConfigError
from hpctrain.train.progress import Progress, format_eta, status_line_wanted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_eta_format():
    assert [format_eta(s) for s in (0, 59.4, 61, 3600 * 2 + 61, float("nan"), -1)] == \
        ["0:00", "0:59", "1:01", "2:01:01", "?", "?"]


def test_the_status_line_is_drawn_on_a_terminal_and_erased_before_a_log_line():
    out = Terminal()
    p = Progress(10, 0, live=True, stream=out)
    p.REDRAW = 0.0
    lines = []
    log = p.wrap(lambda message: (out.write(message + "\n"), lines.append(message)))
    p.advance(1)
    assert out.getvalue().startswith("\r\033[K[###...") and " 1/10  10%" in out.getvalue() and "ETA" in out.getvalue()
    log("step 1")
    assert out.getvalue().endswith("\r\033[Kstep 1\n")
    p.advance(10)
    assert out.getvalue().endswith(f"[{'#' * 30}]  10/10  100%  ETA 0:00")


def test_auto_draws_it_on_a_terminal_only_and_bar_and_lines_decide_alone():
    alone = {}
    assert status_line_wanted("auto", Terminal(), alone) is True
    assert status_line_wanted("auto", io.StringIO(), alone) is False  # a file or a pipe: log lines only
    assert status_line_wanted("bar", io.StringIO(), alone) is True
    assert status_line_wanted("lines", Terminal(), alone) is False
    assert status_line_wanted("auto", io.StringIO(), {"HPCTRAIN_PROGRESS": "bar"}) is True  # the config says auto
    assert status_line_wanted("lines", Terminal(), {"HPCTRAIN_PROGRESS": "bar"}) is False  # the config decides
    with pytest.raises(ConfigError, match="HPCTRAIN_PROGRESS: expected one of auto, bar, lines, got 'yes'"):
        status_line_wanted("auto", Terminal(), {"HPCTRAIN_PROGRESS": "yes"})


def fake_proc(root, chain):
    """A /proc of ``chain`` = [(pid, name, stdout target)] from the rank up: each the parent of the one before."""
    for (pid, name, target), parent in zip(chain, [p for p, _, _ in chain[1:]] + [1]):
        os.makedirs(root / str(pid) / "fd")
        (root / str(pid) / "stat").write_text(f"{pid} ({name}) S {parent} 0 0\n")
        (root / str(pid) / "comm").write_text(name + "\n")
        os.symlink(target, root / str(pid) / "fd" / "1")


@pytest.mark.parametrize("launcher, stdout, want", [
    ("mpiexec", "/dev/pts/4", True),  # MPICH: rank 0 writes to a pipe, mpiexec to the user's terminal
    ("mpiexec", "/home/u/run.log", False),  # mpiexec ... > run.log
    ("mpirun", "pipe:[5521]", False),  # Open MPI: the rank's pty says nothing; mpirun's stdout is a pipe
    ("prterun", "/dev/pts/0", True),
])
def test_under_a_launcher_auto_asks_the_launchers_stdout(tmp_path, launcher, stdout, want):
    fake_proc(tmp_path, [(300, "python", "/dev/pts/9"), (200, "hydra_pmi_proxy", "pipe:[1]"),
                         (100, launcher, stdout), (50, "bash", "/dev/pts/4")])
    launched = {"PMI_RANK": "0"}
    assert status_line_wanted("auto", Terminal(), launched, proc=str(tmp_path), pid=300) is want


def test_under_a_launcher_on_another_node_or_srun_pty(tmp_path):
    fake_proc(tmp_path, [(300, "python", "/dev/pts/9"), (200, "slurmstepd", "/dev/null")])
    assert status_line_wanted("auto", Terminal(), {"SLURM_PROCID": "0"}, proc=str(tmp_path), pid=300) is False
    assert status_line_wanted("auto", io.StringIO(), {"SLURM_PROCID": "0", "SLURM_PTY_PORT": "4242"},
                              proc=str(tmp_path), pid=300) is True


def _train(tmp_path, stdout_is_terminal: bool) -> str:
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 40, "log_every": 20}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = ROOT
    cmd = [sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml")]
    if not stdout_is_terminal:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120).stdout
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=slave, stderr=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # the other end closed
            chunk = b""
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=30)
    os.close(master)
    assert proc.returncode == 0
    return out.decode()


def test_a_run_on_a_terminal_shows_the_status_line_and_in_a_pipe_only_log_lines(tmp_path):
    piped = _train(tmp_path, stdout_is_terminal=False)
    assert "\r" not in piped and "\033[K" not in piped
    steps = [line for line in piped.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(" ETA " in line for line in steps), piped
    (tmp_path / "tty").mkdir()
    live = _train(tmp_path / "tty", stdout_is_terminal=True)
    assert "\r\033[K[" in live and "/40" in live and "ETA" in live, live
    # the status line is erased before the next log line (the memory line after step 1, or step 20's)
    assert "\r\033[Kmemory: peak RSS" in live or "\r\033[Kstep     20/40" in live.replace("\r\n", "\n"), live


def test_the_parameter_server_draws_the_status_line_when_asked(tmp_path):
    """train.progress = "bar" under mpiexec with its output in a pipe: the status line, as the synchronous trainer
    draws it (the parameter server's trainer used to leave it out)."""
    import shutil

    from launch import launcher_env, mpi_command

    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install hpctrain[mpich])")
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 40, "log_every": 20, "progress": "bar"},
                                                parallel={"mode": "async_ps", "staleness": 1}))
    env = launcher_env({"PYTHONPATH": ROOT})
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.run(mpi_command(mpiexec, 3, sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml")),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout  # text mode: each "\r" reads as a newline
    assert "\033[K[" in out and "40/40  100%" in out, out
    assert "\033[Kstep     40/40" in out, out  # erased before the log line
