"""HDF5 datasets and the sampler that fixes which samples every step uses.

The file holds an input dataset (N, ...) and a target dataset (N,) or (N, C);
the last ``val_fraction`` of the rows is the validation split. The data order
is a pure function of the step, so resuming needs only the step number:

* ``shuffle = false``: step s uses training rows s·B … s·B+B−1 (B = global
  batch); an epoch is floor(N_train / B) steps, then the order wraps.
* ``shuffle = true``: epoch e uses ``numpy.random.default_rng([seed, e]).permutation(N_train)``.

Rank r of a data-parallel group of size dp takes the r-th contiguous slice of
B/dp rows of every global batch, and reads only those rows from the file.
"""

from __future__ import annotations

import math
import os

import h5py
import numpy as np

from .errors import DataError

__all__ = ["Dataset", "Sampler", "open_dataset"]

SCAN_ROWS = 1 << 16


class Dataset:
    """One HDF5 file opened read-only; rows are read on demand."""

    def __init__(self, path, inputs, targets, *, val_fraction, loss, in_features, out_features):
        self.path = path
        if not os.path.exists(path):
            raise DataError(f"data file {path} does not exist")
        try:
            self.file = h5py.File(path, "r")
        except OSError as e:
            raise DataError(f"data file {path} is not a readable HDF5 file ({e})") from None
        self.x = self._dataset(inputs, "data.inputs")
        self.y = self._dataset(targets, "data.targets")
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
        self.n_val = int(n * val_fraction)
        self.n_train = n - self.n_val

    def _dataset(self, name, key):
        obj = self.file.get(name)
        if obj is None:
            raise DataError(f"{self.path}: no dataset {name!r} ({key}); it has: {', '.join(self.file.keys()) or 'nothing'}")
        if not isinstance(obj, h5py.Dataset):
            raise DataError(f"{self.path}: {name!r} ({key}) is a group, not a dataset")
        if obj.ndim < 1 or obj.shape[0] == 0:
            raise DataError(f"{self.path}: dataset {name!r} ({key}) is empty")
        return obj

    def close(self):
        self.file.close()

    def read(self, rows: np.ndarray):
        """Inputs (n, features) float32 and targets for the given row indices, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return self._convert(self.x[0:0], self.y[0:0])
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        if hi - lo == len(rows) and np.all(np.diff(rows) == 1):
            return self._convert(self.x[lo:hi], self.y[lo:hi])
        order = np.argsort(rows, kind="stable")
        sorted_rows = rows[order]
        x, y = self.x[sorted_rows], self.y[sorted_rows]  # h5py reads increasing indices
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return self._convert(x[inverse], y[inverse])

    def _convert(self, x, y):
        x = np.ascontiguousarray(x.reshape(len(x), self.features), dtype=np.float32)
        if self.loss.classification:
            y = np.ascontiguousarray(y, dtype=np.int64)
        else:
            y = np.ascontiguousarray(y.reshape(len(y), self.out_features), dtype=np.float32)
        return x, y

    def scan(self, start: int, stop: int) -> str:
        """Check rows [start, stop) for NaN/Inf inputs and bad targets; '' if clean, else the first problem."""
        for lo in range(start, stop, SCAN_ROWS):
            hi = min(stop, lo + SCAN_ROWS)
            x, y = self._convert(self.x[lo:hi], self.y[lo:hi])
            bad = ~np.isfinite(x).all(axis=1)
            if bad.any():
                return f"{self.path}: inputs contain NaN or Inf (first in row {lo + int(np.argmax(bad))})"
            if self.loss.classification:
                bad = (y < 0) | (y >= self.out_features)
                if bad.any():
                    row = lo + int(np.argmax(bad))
                    return (f"{self.path}: target {int(y[row - lo])} in row {row} is not a class index in "
                            f"[0, {self.out_features})")
            elif not np.isfinite(y).all():
                return f"{self.path}: targets contain NaN or Inf (first in row {lo + int(np.argmax(~np.isfinite(y).all(axis=1)))})"
        return ""


class Sampler:
    """Which rows of the training split global step ``s`` uses, and this rank's share of them."""

    def __init__(self, n_train: int, batch_size: int, *, shuffle: bool, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if batch_size > n_train:
            raise DataError(f"train.batch_size = {batch_size} is larger than the training split ({n_train} rows)")
        if batch_size % dp_size:
            raise DataError(f"train.batch_size = {batch_size} is not divisible by the data-parallel size {dp_size}")
        self.n_train, self.batch_size, self.shuffle, self.seed = n_train, batch_size, shuffle, seed
        self.steps_per_epoch = n_train // batch_size
        self.local = batch_size // dp_size
        self.dp_rank = dp_rank
        self._perm_epoch, self._perm = -1, None

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def global_rows(self, step: int) -> np.ndarray:
        epoch, k = divmod(step, self.steps_per_epoch)
        lo = k * self.batch_size
        if not self.shuffle:
            return np.arange(lo, lo + self.batch_size, dtype=np.int64)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_train)
            self._perm_epoch = epoch
        return self._perm[lo : lo + self.batch_size]

    def local_rows(self, step: int) -> np.ndarray:
        lo = self.dp_rank * self.local
        return self.global_rows(step)[lo : lo + self.local]


def open_dataset(cfg, loss, in_features, out_features) -> Dataset:
    d = cfg.data
    return Dataset(d.path, d.inputs, d.targets, val_fraction=d.val_fraction, loss=loss,
                   in_features=in_features, out_features=out_features)
