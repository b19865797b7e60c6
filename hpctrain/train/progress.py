"""How far a run is: an ETA in the log lines, and on a terminal a status line redrawn as steps finish.

    step    400/1500  loss 1.4021  lr 0.001  14,210 tokens/s  (compute ...)  ETA 1:17      <- every log line
    [#########...........................]  412/1500  27%  loss 1.4021  14,210 tokens/s  ETA 1:16   <- terminal

``train.progress`` (or ``HPCTRAIN_PROGRESS`` when the config leaves it at "auto") chooses:
"bar" always draws the status line, "lines" never, and "auto" (``status_line_wanted``)
draws it only where the user sees a terminal: a process started alone, when its stdout is
one; under a launcher (``mpiexec``/``mpirun``/``srun``), when the launcher's own stdout is
(rank 0's stdout is a pipe under MPICH and a pty of Open MPI's even when ``mpirun``'s output
goes to a file, so neither says), or under ``srun --pty``. In a file, a pipe or a Slurm log
there are only the log lines (each flushed as written), so nothing is lost to carriage
returns. The trainer draws it only when it prints with its own ``log_line``. Before a log
line the status line is erased, so the two never mix.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["Progress", "format_eta", "status_line_wanted", "MODES"]

MODES = ("auto", "bar", "lines")
# a process a launcher started says so in its environment (MPICH/Hydra and Intel MPI, Open MPI, Slurm, PMIx)
_LAUNCHED = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMIX_RANK", "MPI_LOCALNRANKS")
_LAUNCHERS = ("mpiexec", "mpirun", "mpiexec.hydra", "prterun", "orterun", "srun")


def format_eta(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on; ``?`` when unknown."""
    if not (seconds >= 0) or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Steps ``start`` to ``total`` of one run on rank 0; ``live`` draws the status line on ``stream``."""

    WIDTH = 30  # characters of the bar
    REDRAW = 0.1  # seconds between redraws at most

    def __init__(self, total: int, start: int, *, live: bool, stream=None):
        """``live``: draw the status line (``status_line_wanted`` decides, with the run's ``train.progress``)."""
        self.total, self.start = total, start
        self.stream = stream or sys.stdout
        self.live = bool(live)
        self.t0 = time.perf_counter()
        self.step = start
        self.summary = ""  # loss and throughput of the last log line
        self._drawn = 0.0
        self._showing = False

    def eta(self) -> str:
        done = self.step - self.start
        if done <= 0:
            return "?"
        return format_eta((time.perf_counter() - self.t0) / done * (self.total - self.step))

    def advance(self, step: int) -> None:
        """A step finished; redraw the status line (at most every REDRAW seconds, and at the last step)."""
        self.step = step
        if not self.live:
            return
        now = time.perf_counter()
        if now - self._drawn < self.REDRAW and step < self.total:
            return
        self._drawn = now
        filled = int(self.WIDTH * step / max(self.total, 1))
        line = (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}]  {step}/{self.total}  {100 * step // max(self.total, 1)}%"
                f"{'  ' + self.summary if self.summary else ''}  ETA {self.eta()}")
        self.stream.write("\r\033[K" + line)
        self.stream.flush()
        self._showing = True

    def wrap(self, log):
        """``log``, erasing the status line before each message (it is redrawn after the next step)."""
        if not self.live:
            return log

        def logged(*args, **kwargs):
            self.clear()
            log(*args, **kwargs)

        return logged

    def clear(self) -> None:
        if self._showing:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._showing = False


def status_line_wanted(mode: str, stream=None, environ=os.environ, *, proc: str = "/proc", pid: int | None = None
                       ) -> bool:
    """Whether rank 0 draws the status line for ``train.progress = mode`` (see the module's docstring)."""
    if mode == "auto":
        mode = environ.get("HPCTRAIN_PROGRESS", "auto")
    if mode in ("bar", "lines"):
        return mode == "bar"
    if mode != "auto":
        from ..errors import ConfigError

        raise ConfigError(f"HPCTRAIN_PROGRESS: expected one of {', '.join(MODES)}, got {mode!r}")
    if not any(v in environ for v in _LAUNCHED):
        return _is_terminal(stream or sys.stdout)
    if environ.get("SLURM_PTY_PORT"):  # srun --pty: rank 0's output goes to the user's terminal
        return True
    return _launcher_stdout_is_terminal(proc, os.getpid() if pid is None else pid)


def _launcher_stdout_is_terminal(proc: str, pid: int) -> bool:
    """Walk up from ``pid`` to the first launcher process on this node; True when its stdout is a terminal.
    No launcher found (it runs on another node, or /proc is not there): False."""
    for _ in range(32):
        try:
            with open(f"{proc}/{pid}/stat") as f:
                stat = f.read()
            with open(f"{proc}/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:
            return False
        if name in _LAUNCHERS:
            try:
                target = os.readlink(f"{proc}/{pid}/fd/1")
            except OSError:
                return False
            return target.startswith(("/dev/pts/", "/dev/tty")) and target != "/dev/tty"
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
        if pid <= 1:
            return False
    return False


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
