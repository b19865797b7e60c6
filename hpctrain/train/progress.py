"""How far a run is: an ETA in the log lines, and on a terminal a status line redrawn as steps finish.

    step    400/1500  loss 1.4021  lr 0.001  14,210 tokens/s  (compute ...)  ETA 1:17      <- every log line
    [#########...........................]  412/1500  27%  loss 1.4021  14,210 tokens/s  ETA 1:16   <- terminal

The status line is drawn only when rank 0's stdout is a terminal and the trainer prints
with its own ``log_line``: in a file, a pipe or a Slurm log there are only the log lines
(each flushed as written), so nothing is lost to carriage returns. Before a log line the
status line is erased, so the two never mix.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress", "format_eta"]


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
        self.total, self.start = total, start
        self.stream = stream or sys.stdout
        self.live = bool(live) and _is_terminal(self.stream)
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


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
