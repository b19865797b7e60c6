"""HDF5 datasets: what the file holds, read on demand and scanned at start-up, and its fingerprint.

The file holds an input dataset (N, ...) and a target dataset (N,) or (N, C),
or, for a language model, one 1-D dataset of token ids cut into N windows of
``block_size + 1`` tokens (``TokenDataset``: sample i is
``tokens[i·T : i·T + T + 1]``, inputs its first T tokens, targets the T after
the first). Either way the last ``val_fraction`` of the N samples is the
validation split (or ``data.val_path``, a second file: ``WithValidation``).
Which rows each step uses is the sampler's (hpctrain/sampling.py); a rank reads
only those rows from the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time

import h5py
import numpy as np

from ._files import H5_ERRORS, member, regular_file, shown, storage_problem
from .errors import DataError

__all__ = ["Dataset", "TokenDataset", "WithValidation", "open_dataset", "fingerprint", "file_fingerprint",
           "token_vocab_size"]

SCAN_ROWS = 1 << 16
SCAN_BYTES = 64 << 20  # the start-up scan holds at most about this much of the file at once
# a batch's rows are read as the one slice that covers them when it is at most this many bytes (or 4x the rows'
# own): h5py's point selection costs ~3x a slice read of a small file (digits: 293 against 97 us a batch)
SLICE_READ_BYTES = 4 << 20
SQRT_FLOAT32_MAX = float(np.sqrt(np.finfo(np.float32).max))  # 1.84e19


def _open_h5(path) -> h5py.File:
    """The data file, read-only and unlocked (like checkpoint reads: the same file may hold checkpoint.init's
    /params, and another reader's lock on a shared file system must not block a training job).

    Only a regular file is opened: a FIFO or a device would block or never end."""
    regular_file(path, f"data file {path}", DataError)
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as e:
        raise DataError(f"data file {path} is not a readable HDF5 file ({shown(e)})") from None


class _Unchanged:
    """The data file as it was opened (device, inode, size, modification time), re-checked before each read.

    HDF5 reads past the end of a truncated file as zeros, and a file rewritten in place holds rows the start-up
    scan never saw: either would train on garbage without a word. Each read checks the open file itself
    (``fstat`` of HDF5's descriptor: no path lookup, which on Lustre or GPFS is a metadata server round trip);
    the path, whose replacement or removal leaves the open file readable but the run's data gone for a resume, is
    looked up at most every ``PATH_CHECK_SECONDS``, so the metadata traffic is bounded by time, not by steps."""

    PATH_CHECK_SECONDS = 60.0

    def _remember(self):
        try:
            self._fd = self.file.id.get_vfd_handle()  # the default (sec2) driver's descriptor
            os.fstat(self._fd)
        except (AttributeError, TypeError, ValueError, OSError, RuntimeError):
            self._fd = None  # another driver: the path is looked up at every read instead
        self._identity = _identity(os.fstat(self._fd) if self._fd is not None else os.stat(self.path))
        self._path_checked = time.monotonic()

    def check_unchanged(self) -> None:
        if self._fd is not None:
            self._compare(_identity(os.fstat(self._fd)))
            if time.monotonic() - self._path_checked < self.PATH_CHECK_SECONDS:
                return
        try:
            now = _identity(os.stat(self.path))
        except OSError as e:
            raise DataError(f"data file {self.path} disappeared while training ({e.strerror or e})") from None
        self._compare(now)
        self._path_checked = time.monotonic()

    def _compare(self, now: tuple) -> None:
        if now != self._identity:
            was, is_ = self._identity, now
            what = ("was replaced by another file" if was[:2] != is_[:2] else
                    f"changed size from {was[2]:,} to {is_[2]:,} bytes" if was[2] != is_[2] else "was rewritten")
            raise DataError(f"data file {self.path} {what} while training: its rows are no longer the ones checked "
                            "at start-up; restore it and resume from the last checkpoint")


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class Dataset(_Unchanged):
    """One HDF5 file opened read-only; rows are read on demand."""

    def __init__(self, path, inputs, targets, *, val_fraction, loss, in_features, out_features, allow_external=False):
        self.path, self.allow_external = path, allow_external
        self.file = _open_h5(path)
        self._remember()
        try:
            self._check(inputs, targets, val_fraction, loss, in_features, out_features)
        except BaseException:
            self.file.close()
            raise

    def _check(self, inputs, targets, val_fraction, loss, in_features, out_features):
        path = self.path
        self.x = self._dataset(inputs, "data.inputs", f"(N, ...) with {in_features} features per row")
        self.y = self._dataset(targets, "data.targets", "(N,)" if loss.classification else f"(N, {out_features})")
        self._labels = (f"dataset {inputs!r} (data.inputs)", f"dataset {targets!r} (data.targets)")
        n = self.x.shape[0]
        if self.y.shape[0] != n:
            raise DataError(f"{path}: inputs {inputs!r} have {n} rows but targets {targets!r} have {self.y.shape[0]}")
        features = math.prod(self.x.shape[1:])
        if features != in_features:
            raise DataError(f"{path}: inputs {inputs!r} have shape {self.x.shape} ({features} features per row) "
                            f"but the model's first layer takes {in_features}")
        if not (np.issubdtype(self.x.dtype, np.floating) or np.issubdtype(self.x.dtype, np.integer)):
            raise DataError(f"{path}: inputs {inputs!r} must be numeric, got dtype {self.x.dtype}")
        loss.check_targets(self.y.shape, self.y.dtype, out_features, f"{path}: targets {targets!r}")
        self.loss, self.features, self.out_features = loss, features, out_features
        self.n_val = validation_count(n, val_fraction)
        self.n_train = n - self.n_val
        # what scan() checks, for the record of a clean scan (scan_cache.py); a dataset in another file: nothing
        self.scan_checks = None if self.allow_external else (
            f"rows: {self._labels[0]} {self.x.shape} {self.x.dtype}, {self._labels[1]} {self.y.shape} {self.y.dtype}, "
            f"loss {loss.name}, {out_features} outputs")

    def _dataset(self, name, key, expected):
        return _get_dataset(self.file, self.path, name, key, expected, self.allow_external)

    def fingerprint(self) -> str:
        """``fingerprint`` of the inputs and targets (computed once)."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = fingerprint(self.path, [self.x, self.y])
        return self._fingerprint

    def close(self):
        self.file.close()

    def read(self, rows: np.ndarray):
        """Inputs (n, features) float32 and targets for the given row indices, in that order."""
        self.check_unchanged()
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return self._convert(self.x[0:0], self.y[0:0])
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        if hi - lo == len(rows) and np.all(np.diff(rows) == 1):
            return self._convert(*self._fetch(slice(lo, hi)))
        first, last = int(rows.min()), int(rows.max())
        row_bytes = self.x.dtype.itemsize * self.features + self.y.dtype.itemsize * (self.y.size // max(1, len(self.y)))
        if (last - first + 1) * row_bytes <= max(SLICE_READ_BYTES, 4 * len(rows) * row_bytes):
            try:
                x, y = self._fetch(slice(first, last + 1))  # the covering slice, then the rows out of it
                return self._convert(x[rows - first], y[rows - first])
            except DataError:
                pass  # a bad chunk between the rows: read the rows themselves (which may not touch it)
        order = np.argsort(rows, kind="stable")
        sorted_rows = rows[order]
        x, y = self._fetch(sorted_rows)  # h5py reads increasing indices
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return self._convert(x[inverse], y[inverse])

    def _fetch(self, rows):
        """Raw (inputs, targets) for ``rows`` (a slice or increasing indices); a failed HDF5 read is a DataError."""
        out = []
        for dset, label in zip((self.x, self.y), self._labels):
            try:
                out.append(dset[rows])
            except H5_ERRORS as e:  # a corrupt gzip/fletcher32 chunk, a missing external file, a missing filter
                raise DataError(f"{self.path}: cannot read {_rows_text(dset, rows)} of {label}: {shown(e)}") from None
        return out

    def _convert(self, x, y):
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become Inf; scan() reports them
            x = np.ascontiguousarray(x.reshape(len(x), self.features), dtype=np.float32)
            if self.loss.classification:
                y = np.ascontiguousarray(y, dtype=np.int64)
            else:
                y = np.ascontiguousarray(y.reshape(len(y), self.out_features), dtype=np.float32)
        return x, y

    def scan(self, start: int, stop: int) -> str:
        """Check rows [start, stop) for NaN/Inf inputs and bad targets; '' if clean, else the first problem.

        An unreadable row raises DataError instead.
        """
        row_bytes = self.features * max(self.x.dtype.itemsize, 4) + self.out_features * 8
        step = max(1, min(SCAN_ROWS, SCAN_BYTES // row_bytes))
        for lo in range(start, stop, step):
            hi = min(stop, lo + step)
            x_raw, y_raw = self._fetch(slice(lo, hi))
            x, y = self._convert(x_raw, y_raw)
            bad = ~np.isfinite(x).all(axis=1)
            if bad.any():
                return self._nonfinite("inputs", lo, int(np.argmax(bad)), x_raw)
            huge = _huge("inputs", x, lo)  # its square, in Adam's state, overflows float32
            if huge:
                return f"{self.path}: {huge}"
            if self.loss.classification:
                bad = (y_raw < 0) | (y_raw >= self.out_features)  # on the file's integers: a cast could wrap
                if bad.any():
                    i = int(np.argmax(bad))
                    return (f"{self.path}: target {int(y_raw[i])} in row {lo + i} is not a class index in "
                            f"[0, {self.out_features})")
            else:
                bad = ~np.isfinite(y).all(axis=1)
                if bad.any():
                    return self._nonfinite("targets", lo, int(np.argmax(bad)), y_raw)
                huge = _huge("targets", y, lo)  # the squared error overflows float32
                if huge:
                    return f"{self.path}: {huge}"
        return ""

    def _nonfinite(self, what, lo, i, raw):
        """The message for row lo + i, whose float32 copy is not finite: NaN/Inf in the file, or out of range."""
        row = np.asarray(raw[i], dtype=np.float64).ravel() if np.issubdtype(raw.dtype, np.floating) else None
        if row is not None and np.isfinite(row).all():
            value = row[np.argmax(np.abs(row))]
            return (f"{self.path}: {what} contain a value beyond the float32 range ({value:.6g} in row {lo + i}); "
                    "rescale the data")
        return f"{self.path}: {what} contain NaN or Inf (first in row {lo + i})"


def _huge(what: str, values: np.ndarray, lo: int) -> str:
    """'' unless a row of ``values`` (rows lo..) holds a value whose square overflows float32; else why."""
    huge = (np.abs(values) >= SQRT_FLOAT32_MAX).any(axis=1)
    if not huge.any():
        return ""
    i = int(np.argmax(huge))
    value = values[i][np.argmax(np.abs(values[i]))]
    return (f"{what} contain a value whose square overflows float32 ({value:.6g} in row {lo + i}; the limit is "
            f"{SQRT_FLOAT32_MAX:.3g}): rescale the data")


def validation_count(n: int, val_fraction: float) -> int:
    """floor(n · val_fraction) of the fraction as written (0.29 is 0.28999… in binary: 100 · it is 29, not 28)."""
    from decimal import Decimal

    return int(Decimal(repr(val_fraction)) * n)


def _get_dataset(file, path, name, key, expected, allow_external):
    """The dataset ``name`` of an open file; DataError naming ``key`` unless it holds rows of this file.

    External storage, virtual datasets and external links are refused unless ``allow_external``
    (``data.allow_external``); so are storage never written and sizes the file cannot hold.
    """
    try:
        obj, problem = member(file, name, allow_external=allow_external)
        if obj is None and not problem:
            names = [shown(n) for n in file.keys()]
            raise DataError(f"{path}: no dataset {name!r} ({key}); it has: {', '.join(names) or 'nothing'}")
        if problem:
            hint = "; set data.allow_external = true to follow it" if "external link" in problem else ""
            raise DataError(f"{path}: dataset {name!r} ({key}) {problem}{hint}")
        if not isinstance(obj, h5py.Dataset):
            raise DataError(f"{path}: {name!r} ({key}) is a group, not a dataset")
        shape = obj.shape
        problem = storage_problem(obj, os.path.getsize(path), allow_external=allow_external)
    except H5_ERRORS as e:  # damaged metadata, a type h5py cannot represent
        raise DataError(f"{path}: dataset {name!r} ({key}) cannot be opened: {shown(e)}") from None
    if shape is None:
        raise DataError(f"{path}: dataset {name!r} ({key}) holds no data (an empty dataspace); "
                        f"expected shape {expected}")
    if problem:
        hint = "; set data.allow_external = true to read it" if "which hpctrain refuses" in problem else ""
        raise DataError(f"{path}: dataset {name!r} ({key}) {problem}{hint}")
    if len(shape) == 0:
        raise DataError(f"{path}: dataset {name!r} ({key}) is a scalar; expected one row per sample, "
                        f"shape {expected}")
    if shape[0] == 0:
        raise DataError(f"{path}: dataset {name!r} ({key}) is empty (shape {shape}); expected shape {expected}")
    return obj


def token_vocab_size(path, name, *, allow_external=False) -> int:
    """How many token ids the dataset ``name`` of ``path`` declares: its ``vocabulary`` (characters), else its
    tokenizer's ``n_vocab`` attribute (``data text2h5 --tokenizer``), else its largest id + 1 (read in slices of
    1M ids); 0 when the file or the dataset cannot be read (the start-up reports why)."""
    try:
        f = _open_h5(path)
    except DataError:
        return 0
    try:
        obj, problem = member(f, name, allow_external=allow_external)
        if problem or not isinstance(obj, h5py.Dataset) or len(obj.shape or ()) != 1 or \
                not np.issubdtype(obj.dtype, np.integer) or obj.shape[0] == 0:
            return 0
        if "vocabulary" in obj.attrs:
            return int(np.asarray(obj.attrs["vocabulary"]).size)
        if "n_vocab" in obj.attrs:
            return int(obj.attrs["n_vocab"])
        top, step = -1, SCAN_ROWS * 16
        for lo in range(0, obj.shape[0], step):
            top = max(top, int(obj[lo : lo + step].max()))
        return top + 1 if top >= 0 else 0
    except H5_ERRORS:
        return 0
    finally:
        f.close()


class TokenDataset(_Unchanged):
    """Windows of a 1-D token dataset, read on demand: ``read(rows)`` -> ids (n, T) and targets (n·T,);
    ``read_at(starts)``: the windows that begin at those token positions (``data.sampling = "random"``)."""

    def __init__(self, path, tokens, *, block_size, val_fraction, vocab_size, allow_external=False,
                 random_windows=False):
        self.path, self.T, self.vocab_size, self.allow_external = path, block_size, vocab_size, allow_external
        self.random_windows = random_windows  # data.sampling = "random": a window may start at any token
        self.file = _open_h5(path)
        self._remember()
        try:
            self._check(tokens, val_fraction)
        except BaseException:
            self.file.close()
            raise

    def _check(self, name, val_fraction):
        path, T = self.path, self.T
        self.tokens = _get_dataset(self.file, path, name, "data.tokens", "(N,) token ids", self.allow_external)
        if len(self.tokens.shape) != 1 or not np.issubdtype(self.tokens.dtype, np.integer):
            raise DataError(f"{path}: dataset {name!r} (data.tokens) must be 1-D integer token ids, got shape "
                            f"{self.tokens.shape} and dtype {self.tokens.dtype}")
        count = self.tokens.shape[0]
        if count < T + 1:
            raise DataError(f"{path}: dataset {name!r} holds {count} tokens, shorter than one window of "
                            f"model.block_size + 1 = {T + 1}")
        from .text import read_vocabulary

        tok = read_vocabulary(path, name, allow_external=self.allow_external)
        self.vocabulary = tok.vocabulary if tok is not None else ""  # kept in checkpoints, for `hpctrain sample`
        if len(self.vocabulary) > self.vocab_size:
            raise DataError(f"{path}: the vocabulary of {name!r} has {len(self.vocabulary)} characters but "
                            f"model.vocab_size = {self.vocab_size}; set vocab_size >= {len(self.vocabulary)}")
        from .tokens import bpe_attrs

        bpe = bpe_attrs(self.tokens.attrs)  # subword tokens (hpctrain/tokens.py): kept in checkpoints too
        self.tokenizer = json.dumps({k: bpe[k] for k in ("name", "sha256", "n_vocab")}, sort_keys=True) if bpe else ""
        if bpe and bpe["n_vocab"] > self.vocab_size:
            raise DataError(f"{path}: the tokenizer of {name!r} ({bpe['name']}) has {bpe['n_vocab']} ids but "
                            f"model.vocab_size = {self.vocab_size}; set vocab_size >= {bpe['n_vocab']}")
        self._label = f"dataset {name!r} (data.tokens)"
        self.scan_checks = None if self.allow_external else \
            f"tokens: {self._label} {self.tokens.shape} {self.tokens.dtype}, vocabulary {self.vocab_size}, " \
            f"windows of {T}" + (", from any token" if self.random_windows else "")  # the scan reads the tokens
        # the windows reach: another block size, or random starts (data.sampling = "random"), reach others
        n = (count - 1) // T
        self.n_val = validation_count(n, val_fraction)
        self.n_train = n - self.n_val
        # data.sampling = "random": a window may start at any token of the training split that leaves it whole
        # (nanoGPT's randint(len(data) - block_size)); with a validation split, before the first validation window
        self.n_starts = (count if self.n_val == 0 else self.n_train * T + 1) - T

    def close(self):
        self.file.close()

    def fingerprint(self) -> str:
        """``fingerprint`` of the tokens (computed once)."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = fingerprint(self.path, [self.tokens])
        return self._fingerprint

    def _fetch(self, lo: int, hi: int) -> np.ndarray:
        try:
            return self.tokens[lo:hi]
        except H5_ERRORS as e:
            raise DataError(f"{self.path}: cannot read tokens {lo} to {hi - 1} of {self._label}: {shown(e)}") from None

    def read(self, rows: np.ndarray):
        """Token ids (n, T) int64 and targets (n·T,) int64 of the windows ``rows``, in that order."""
        self.check_unchanged()
        rows = np.asarray(rows, dtype=np.int64)
        T = self.T
        windows = np.empty((len(rows), T + 1), dtype=np.int64)
        order = np.argsort(rows, kind="stable")
        k = 0
        while k < len(order):  # one read per run of consecutive windows
            j = k
            while j + 1 < len(order) and rows[order[j + 1]] == rows[order[j]] + 1:
                j += 1
            first = int(rows[order[k]])
            chunk = self._fetch(first * T, (int(rows[order[j]]) + 1) * T + 1)
            for m in range(k, j + 1):
                at = (int(rows[order[m]]) - first) * T
                windows[order[m]] = chunk[at : at + T + 1]
            k = j + 1
        return np.ascontiguousarray(windows[:, :T]), np.ascontiguousarray(windows[:, 1:]).reshape(-1)

    def read_at(self, starts: np.ndarray):
        """Token ids (n, T) int64 and targets (n·T,) int64 of the windows beginning at token positions ``starts``."""
        self.check_unchanged()
        T = self.T
        windows = np.empty((len(starts), T + 1), dtype=np.int64)
        for i, a in enumerate(np.asarray(starts, dtype=np.int64).tolist()):
            windows[i] = self._fetch(a, a + T + 1)
        return np.ascontiguousarray(windows[:, :T]), np.ascontiguousarray(windows[:, 1:]).reshape(-1)

    def scan(self, start: int, stop: int) -> str:
        """Check the tokens of windows [start, stop) are ids in [0, vocab_size); '' if clean, else the first problem."""
        lo, hi = start * self.T, stop * self.T + 1 if stop > start else start * self.T
        if self.random_windows and stop == self.n_train + self.n_val and stop > start:  # random starts reach the tail
            hi = self.tokens.shape[0]
        for a in range(lo, hi, SCAN_ROWS * 16):
            ids = self._fetch(a, min(hi, a + SCAN_ROWS * 16))
            bad = (ids < 0) | (ids >= self.vocab_size)
            if bad.any():
                i = int(np.argmax(bad))
                return (f"{self.path}: token id {int(ids[i])} at position {a + i} of {self._label} is outside the "
                        f"vocabulary [0, {self.vocab_size}) (model.vocab_size)")
        return ""


def token_mismatch(checkpoint: str, state, data) -> str:
    """'' when the token file ``data`` (a TokenDataset) holds ids of the vocabulary or tokenizer the checkpoint
    ``state`` was trained on (or either does not say); else one line saying how they differ."""
    ours, theirs = getattr(data, "vocabulary", ""), getattr(state, "vocabulary", "")
    if ours and theirs and ours != theirs:
        return (f"{checkpoint} was trained on a vocabulary of {len(theirs)} characters and {data.path} holds ids of "
                f"another ({len(ours)} characters): its token ids would mean other characters")
    ours, theirs = getattr(data, "tokenizer", ""), getattr(state, "tokenizer", "")
    if ours and theirs and ours != theirs:
        return (f"{checkpoint} was trained on tokenizer {theirs} and {data.path} was tokenized with {ours}: its "
                "token ids would mean other tokens")
    if bool(getattr(data, "vocabulary", "")) != bool(getattr(state, "vocabulary", "")) and \
            (getattr(state, "tokenizer", "") or getattr(data, "tokenizer", "")):
        return f"{checkpoint} and {data.path}: one holds character ids, the other subword ids"
    return ""


def _rows_text(dset, rows) -> str:
    """The rows a failed read covers: for a slice, the first chunk in it that fails again; else the indices."""
    if isinstance(rows, slice):
        lo, hi = rows.start, rows.stop
        step = dset.chunks[0] if dset.chunks else hi - lo
        for a in range(lo - lo % step, hi, step):
            a, b = max(a, lo), min(hi, a + step)
            try:
                dset[a:b]
            except H5_ERRORS:
                return f"rows {a} to {b - 1}"
        return f"rows {lo} to {hi - 1}"
    shown = ", ".join(str(int(r)) for r in rows[:4])
    return f"rows {shown}" if len(rows) <= 4 else f"rows {shown}, … ({len(rows)} rows from {rows[0]} to {rows[-1]})"


class WithValidation:
    """``data.val_path``: the training file (every window of it training data) and a separate validation file,
    as one dataset whose rows [0, n_train) are the first file's and [n_train, n_train + n_val) the second's."""

    def __init__(self, train, val):
        self.train, self.val = train, val
        self.path = train.path
        self.n_train, self.n_val = train.n_train, val.n_train
        self.n_starts = getattr(train, "n_starts", 0)
        self.scan_checks = None  # the scan cache knows one file: both are scanned at every start
        self.vocabulary = getattr(train, "vocabulary", "")
        self.tokenizer = getattr(train, "tokenizer", "")
        theirs = getattr(val, "vocabulary", "")
        if self.vocabulary and theirs and theirs != self.vocabulary:
            raise DataError(f"data.val_path {val.path}: its vocabulary ({len(theirs)} characters) is not the one "
                            f"of data.path {train.path} ({len(self.vocabulary)}): its ids would mean other tokens")
        if (self.tokenizer or getattr(val, "tokenizer", "")) and getattr(val, "tokenizer", "") != self.tokenizer:
            raise DataError(f"data.val_path {val.path}: its tokenizer ({getattr(val, 'tokenizer', '') or 'none'}) is "
                            f"not the one of data.path {train.path} ({self.tokenizer or 'none'})")

    def close(self):
        try:
            self.train.close()
        finally:
            self.val.close()

    def fingerprint(self) -> str:
        both = f"{self.train.fingerprint()} {self.val.fingerprint()}".encode()
        return f"{FINGERPRINT_VERSION}:{hashlib.sha256(both).hexdigest()[:16]}"

    def read(self, rows: np.ndarray):
        rows = np.asarray(rows, dtype=np.int64)
        val = rows >= self.n_train
        if not val.any():
            return self.train.read(rows)
        if val.all():
            return self.val.read(rows - self.n_train)
        if np.any(np.diff(val.astype(np.int8)) < 0):
            raise AssertionError("rows of both files are read training rows first")
        return tuple(np.concatenate(pair) for pair in zip(self.train.read(rows[~val]),
                                                          self.val.read(rows[val] - self.n_train)))

    def read_at(self, starts):
        return self.train.read_at(starts)

    def scan(self, start: int, stop: int) -> str:
        a = self.train.scan(min(start, self.n_train), min(stop, self.n_train)) if start < self.n_train else ""
        lo, hi = max(start, self.n_train) - self.n_train, max(stop, self.n_train) - self.n_train
        return a or (self.val.scan(lo, hi) if hi > lo else "")


FINGERPRINT_VERSION = "v1"  # what is hashed: fingerprints of another version are not compared
FINGERPRINT_WHOLE_BYTES = 32 << 20  # a dataset up to this size is hashed whole
FINGERPRINT_SLICES = 16  # a larger one: this many slices spread over its rows,
FINGERPRINT_VALUES = 4096  # of about this many values each


def fingerprint(path, datasets) -> str:
    """What a data file holds for a run, as ``v1:`` and 16 hex digits: each dataset's shape and dtype and its values,
    hashed (SHA-256): every value of a dataset up to 32 MiB, else 16 slices of about 4096 values spread over its
    rows (the first and the last among them; a change between them goes unnoticed). A copy of the file, or the
    same values written again, gives the same. Read on one rank at start-up: a few milliseconds for a small
    file, a few small reads for a large one (whose values the start-up scan checks). Checkpoints keep it
    (``data_fingerprint``), so that ``resume = "auto"`` can tell a run continued on other data
    (train/resume_check.py)."""
    h = hashlib.sha256()
    for d in datasets:
        dtype = np.dtype(d.dtype).newbyteorder("<")
        h.update(f"{tuple(d.shape)} {dtype.str};".encode())
        n, row = d.shape[0], math.prod(d.shape[1:]) or 1
        whole = n * row * dtype.itemsize <= FINGERPRINT_WHOLE_BYTES
        take = n if whole else max(1, min(n, FINGERPRINT_VALUES // row))
        for i in range(1 if whole else FINGERPRINT_SLICES):
            lo = 0 if whole else (n - take) * i // (FINGERPRINT_SLICES - 1)
            try:
                values = d[lo : lo + take]
            except H5_ERRORS as e:
                raise DataError(f"{path}: cannot read rows {lo} to {lo + take - 1} of {d.name!r}: {shown(e)}") from None
            h.update(np.ascontiguousarray(values, dtype=dtype).tobytes())
    return f"{FINGERPRINT_VERSION}:{h.hexdigest()[:16]}"


def file_fingerprint(cfg) -> str:
    """``fingerprint`` of ``cfg.data``'s datasets, the file opened for it (a rank that holds no ``Dataset``: the
    parameter server's); DataError when they cannot be read."""
    names = [cfg.data.tokens] if cfg.model.kind == "gpt" else [cfg.data.inputs, cfg.data.targets]
    prints = []
    for path in filter(None, (cfg.data.path, cfg.data.val_path)):
        f = _open_h5(path)
        try:
            datasets = []
            for name in names:
                obj = f.get(name)
                if not isinstance(obj, h5py.Dataset):
                    raise DataError(f"{path}: no dataset {name!r}")
                datasets.append(obj)
            prints.append(fingerprint(path, datasets))
        finally:
            f.close()
    if len(prints) == 1:
        return prints[0]
    return f"{FINGERPRINT_VERSION}:{hashlib.sha256(' '.join(prints).encode()).hexdigest()[:16]}"


def open_dataset(cfg, loss, model) -> Dataset | TokenDataset | WithValidation:
    """The data of ``cfg.data`` for ``model`` (a model spec): token windows for the GPT, rows for the MLP; with
    ``data.val_path`` both files as one (WithValidation)."""
    d = cfg.data

    def one(path, val_fraction):
        if cfg.model.kind == "gpt":
            return TokenDataset(path, d.tokens, block_size=model.block_size, val_fraction=val_fraction,
                                vocab_size=model.vocab_size, allow_external=d.allow_external,
                                random_windows=d.sampling == "random")
        return Dataset(path, d.inputs, d.targets, val_fraction=val_fraction, loss=loss, in_features=model.in_features,
                       out_features=model.out_features, allow_external=d.allow_external)

    if not d.val_path:
        return one(d.path, d.val_fraction)
    train = one(d.path, 0.0)
    try:
        val = one(d.val_path, 0.0)
    except BaseException:
        train.close()
        raise
    try:
        return WithValidation(train, val)
    except BaseException:
        train.close()
        val.close()
        raise
