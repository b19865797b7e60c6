"""Metrics lines (JSONL on rank 0, or a CSV table; TensorBoard beside them) and the per-step time split behind the
progress lines."""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from .._files import failure, open_for_writing, replaced_atomically
from ..errors import ConfigError
from ..parallel.executor import bubble_share
from .sinks import CsvTable, TensorBoard

__all__ = ["MetricsFile", "Window", "truncate_after"]


class MetricsFile:
    """JSONL metrics on rank 0: one object a line, flushed as written; the file is ``flock``-ed while it is
    open, so a second job given the same ``train.metrics`` stops with one line instead of interleaving.

    A resumed run keeps the lines up to the step it resumes from and appends after them.
    NaN and Inf (a skipped non-finite step) are written as null, so every line is valid JSON.
    A path ending in ``.csv`` is one CSV table instead (train/sinks.py); ``tensorboard``, a folder, receives every
    record's numbers as TensorBoard scalars too.
    """

    def __init__(self, path, resume_step=0, on_record=None, tensorboard=""):
        """``on_record``: called with each record (a dict) as it is written, with or without a file."""
        self.f, self.path, self.failed, self.on_record = None, path, False, on_record
        self.table = self.board = None
        if tensorboard:
            self.board = TensorBoard(tensorboard, resume_step)
        if not path:
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.islink(path):  # before a resume rewrites it: nothing is read or written through a link
            raise ConfigError(f"train.metrics: {path} is a symbolic link; hpctrain writes only regular files it can name")
        _claim(path)  # another live run's file is refused before anything in it is changed
        resume = resume_step > 0 and os.path.lexists(path)
        csv_table = path.endswith(".csv")
        if resume and not csv_table:
            truncate_after(path, resume_step)
        # never through a link; a CSV table is read (to resume) and rewritten in place
        self.f = open_for_writing(path, "train.metrics", ConfigError, append=resume and not csv_table,
                                  update=csv_table)
        try:
            _lock(self.f.fileno(), path)  # held until close(): the kernel drops it when the process dies
            if csv_table:
                self.table = CsvTable(self.f, path, resume_step if resume else 0)
        except BaseException:
            self.f.close()
            raise

    def write(self, record):
        if self.on_record is not None:
            self.on_record(dict(record))
        if self.board is not None:
            self.board.write(record)
        if self.f and not self.failed:
            try:
                if self.table is not None:
                    self.table.write(record)
                else:
                    self.f.write(json.dumps(_finite(record), allow_nan=False) + "\n")
                    self.f.flush()
            except OSError as e:  # a full disk, a quota, a folder gone read-only
                self.failed = True
                raise ConfigError(f"train.metrics: cannot write {self.path}: {failure(e)}") from None

    def close(self):
        """Close the file; after a failed write the buffer that failed is dropped, not flushed (and failed) again."""
        if self.board is not None:
            board, self.board = self.board, None
            board.close()
        if self.f:
            f, self.f = self.f, None
            try:
                f.close()
            except OSError as e:
                if not self.failed:
                    raise ConfigError(f"train.metrics: cannot write {self.path}: {failure(e)}") from None


def _lock(fd: int, path: str) -> None:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"train.metrics: {path} is being written by another running job (it holds the file's "
                          "lock); give each run its own train.metrics") from None
    except OSError:
        pass  # a file system without flock: the checkpoint folder's lock still keeps one job per run


def _claim(path: str) -> None:
    """Refuse ``path`` if another live run holds its lock (checked on the file as it is, before a resume rewrites
    it or a new run truncates it)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # absent, or refused with one line by open_for_writing
    try:
        _lock(fd, path)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _finite(value):
    if isinstance(value, np.generic):  # a numpy scalar: json writes Python numbers only
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


MAX_METRICS_BYTES = 1 << 30  # a metrics file to resume is read line by line, and only up to this size


def truncate_after(path, step):
    """Drop the metrics lines of steps after ``step`` (left by a run that went on past the checkpoint).

    Only a regular file of at most MAX_METRICS_BYTES is read (a FIFO would block), one line at a time.
    """
    from .._files import regular_file
    from ..errors import ConfigError

    size = regular_file(path, f"train.metrics: {path}", ConfigError).st_size
    if size > MAX_METRICS_BYTES:
        raise ConfigError(f"train.metrics: {path} is larger than {MAX_METRICS_BYTES >> 30} GiB; move it away to resume")

    def kept_lines():
        with open(path, encoding="utf-8", errors="surrogateescape") as f:  # lines that are not ours stay as they are
            for line in f:
                try:
                    record_step = json.loads(line).get("step", 0)
                except (ValueError, AttributeError, RecursionError):
                    # not a metrics record: kept as it is, unless it is one cut short (the last line, with no
                    # newline: a run killed while writing it), which the next record would be glued onto
                    yield line, line.endswith("\n")
                    continue
                yield line, not isinstance(record_step, int) or record_step <= step

    if all(keep for _, keep in kept_lines()) and _ends_a_line(path, size):
        return
    with replaced_atomically(path, f"train.metrics: cannot rewrite {path}", ConfigError) as tmp, \
            open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line, keep in kept_lines() if keep)


def _ends_a_line(path, size: int) -> bool:
    """Whether the file is empty or ends with a newline (else what is appended next would join its last line)."""
    if size == 0:
        return True
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) == b"\n"


class Window:
    """Per-step time split and throughput since the last training log line (this rank's stage)."""

    KEYS = ("compute", "comm", "optim", "data", "busy", "wait", "span")

    def __init__(self):
        self.totals, self.steps, self.start = dict.fromkeys(self.KEYS, 0.0), 0, time.perf_counter()
        self.peak_live = self.peak_bytes = 0

    def add(self, timing):
        for k in self.KEYS:
            self.totals[k] += timing[k]
        self.peak_live = max(self.peak_live, timing["peak_live"])
        self.peak_bytes = max(self.peak_bytes, timing["peak_bytes"])
        self.steps += 1

    def stage_figures(self) -> list[float]:
        """Means per step of busy, wait and span seconds, the bubble share, and the peaks (for a Gather)."""
        n = max(self.steps, 1)
        mean = {k: v / n for k, v in self.totals.items()}
        bubble = bubble_share(**{k: mean[k] for k in ("busy", "data", "span", "comm", "optim")})
        return [mean["busy"], mean["wait"], mean["span"], bubble, float(self.peak_live), float(self.peak_bytes)]

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation, a checkpoint write) out of the throughput: it is not training."""
        self.start += seconds

    def flush(self, batch_size):
        now = time.perf_counter()
        n = max(self.steps, 1)
        means = {k: v / n for k, v in self.totals.items()}
        rate = self.steps * batch_size / max(now - self.start, 1e-9)
        self.totals, self.steps, self.start = dict.fromkeys(self.KEYS, 0.0), 0, now
        return means, rate
