"""Progress: an ETA in every log line; on a terminal a status line between the log lines, never in a file."""

import io
import os
import pty
import select
import subprocess
import sys

from helpers import make_classification, toml_job
from hpctrain.train.progress import Progress, format_eta

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
    assert Progress(10, 0, live=True, stream=io.StringIO()).live is False  # not a terminal: no status line


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
