"""The metrics records for other tools: a CSV table (``train.metrics`` ending in ``.csv``) and TensorBoard event
files (``train.tensorboard``, a folder; needs ``tensorboardX``, no torch).

A record (train/loop.py) is a dict: ``step``, scalars (``loss``, ``lr``, ``val_accuracy``, ...) and nested values
(``stages``: one dict per pipeline stage). Both sinks take its scalars, nested ones named by their path
(``stages.1.bubble``); the ``memory`` record's per-rank table stays in the JSONL file and ``hpctrain plot``.

CSV: one row a record, one column a name, in the order first seen; a record with a name not seen before rewrites
the file with the wider header (the rows are few: one per ``train.log_every`` steps), so the file is always one
table that pandas, a spreadsheet or ``csv.DictReader`` reads as it is. A resumed run keeps the rows up to the
step it resumes from. NaN and Inf (a skipped step) are written as ``nan``/``inf``, which those readers parse.
"""

from __future__ import annotations

import csv
import math
import os

import numpy as np

from ..errors import ConfigError

__all__ = ["CsvTable", "TensorBoard", "scalars"]

SKIPPED = ("memory",)  # a record's per-rank table: JSONL only


def scalars(record: dict, prefix: str = "") -> dict:
    """``record``'s numbers and strings by their path (``stages.0.bubble``); booleans as 0/1."""
    out = {}
    for key, value in record.items():
        if not prefix and key in SKIPPED:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, np.generic):  # a numpy scalar (the parameter server's loss): a Python number
            value = value.item()
        if isinstance(value, dict):
            out.update(scalars(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out.update(scalars({str(i): v for i, v in enumerate(value)}, name + "."))
        elif isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, (int, float, str)):
            out[name] = value
    return out


def _cell(value) -> str:
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    return str(value)


class CsvTable:
    """The CSV form of a metrics file, written through ``f`` (a text file opened to read and write, which the
    caller locked). Rows are not kept in memory: a new column rewrites the file from what it holds."""

    MAX_BYTES = 1 << 30  # a table to resume or widen is read whole, and only up to this size

    def __init__(self, f, path: str, resume_step: int = 0):
        self.f, self.path = f, path
        self.columns: list[str] = ["step"]
        rows = self._rows(resume_step) if resume_step > 0 else []
        self._rewrite(rows)

    def _read(self) -> list[list[str]]:
        if os.fstat(self.f.fileno()).st_size > self.MAX_BYTES:
            raise ConfigError(f"train.metrics: {self.path} is larger than {self.MAX_BYTES >> 30} GiB; move it away")
        self.f.seek(0)
        return list(csv.reader(self.f))

    def _rows(self, resume_step: int) -> list[list[str]]:
        """The rows of steps up to ``resume_step`` in the file as it is; a file that is not hpctrain's table is
        refused rather than overwritten."""
        table = self._read()
        if not table:
            return []
        if not table[0] or table[0][0] != "step":
            raise ConfigError(f"train.metrics: {self.path} is not a metrics table hpctrain wrote (its first column "
                              "is not 'step'); move it away or name another train.metrics")
        self.columns = table[0]
        kept = []
        for row in table[1:]:
            try:
                if int(row[0]) <= resume_step:
                    kept.append(row)
            except (IndexError, ValueError):
                continue
        return kept

    def write(self, record: dict) -> None:
        row = {k: _cell(v) for k, v in scalars(record).items()}
        if len(row) <= 1:  # nothing but the step (the memory record): no row
            return
        new = [k for k in row if k not in self.columns]
        if new:  # a wider header: the rows so far get empty cells in the new columns
            rows = self._read()[1:]
            self.columns += new
            self._rewrite(rows)
        csv.writer(self.f, lineterminator="\n").writerow([row.get(c, "") for c in self.columns])
        self.f.flush()

    def _rewrite(self, rows: list[list[str]]) -> None:
        self.f.seek(0)
        self.f.truncate()
        out = csv.writer(self.f, lineterminator="\n")
        out.writerow(self.columns)
        width = len(self.columns)
        out.writerows(row[:width] + [""] * (width - len(row)) for row in rows)
        self.f.flush()


def tag(name: str) -> str:
    """The TensorBoard tag of a metrics name: ``val_loss`` -> ``val/loss``, ``loss`` -> ``train/loss``."""
    return "val/" + name[len("val_"):] if name.startswith("val_") else "train/" + name


class TensorBoard:
    """Each record's numbers as TensorBoard scalars (step: the record's step), on rank 0, in two groups as
    PyTorch users name them: ``val/loss``, ``val/accuracy`` for the validation figures (``val_*``), ``train/<name>``
    for the others (``train/loss``, ``train/lr``, ``train/samples_per_s``, ``train/stages.1.bubble``)."""

    def __init__(self, logdir: str, resume_step: int = 0):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError(f"train.tensorboard = {logdir!r} needs the tensorboardX package (pip install "
                              "'hpctrain[tensorboard]'; no torch needed), or leave train.tensorboard empty") from None
        try:
            os.makedirs(logdir, exist_ok=True)
        except OSError as e:  # a file there, or a folder that cannot be made: one line, before training
            raise ConfigError(f"train.tensorboard: {logdir} is not a folder that can be written "
                              f"({e.strerror or type(e).__name__})") from None
        # a resumed run hides what an earlier run logged after the step it resumes from
        self.writer = SummaryWriter(logdir=logdir, purge_step=resume_step + 1 if resume_step > 0 else None)

    def write(self, record: dict) -> None:
        step = record.get("step", 0)
        for name, value in scalars(record).items():
            if name != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(tag(name), float(value), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
