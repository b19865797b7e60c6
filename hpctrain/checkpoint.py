"""HDF5 weights files and checkpoints.

A weights-only file is HDF5 with a group ``/params`` holding one float32
dataset per parameter, named and shaped as torch's ``state_dict()``.
"""

from __future__ import annotations

import os
import tempfile

import h5py
import numpy as np

from .errors import CheckpointError

__all__ = ["save_weights", "load_weights"]


def save_weights(path: str, params: dict[str, np.ndarray]) -> None:
    """Write ``/params/<name>`` datasets atomically (temporary file, fsync, rename)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".h5", dir=folder)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            group = f.create_group("params")
            for name, arr in params.items():
                group.create_dataset(name, data=np.asarray(arr, dtype=np.float32), fletcher32=True)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_weights(path: str, layout) -> dict[str, np.ndarray]:
    """Read ``/params`` from a weights file or checkpoint; names and shapes must match ``layout`` exactly."""
    if not os.path.exists(path):
        raise CheckpointError(f"weights file {path} does not exist")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CheckpointError(f"weights file {path} is not a readable HDF5 file ({e})") from None
    with f:
        group = f.get("params")
        if not isinstance(group, h5py.Group):
            raise CheckpointError(f"weights file {path} has no /params group")
        have = set(group.keys())
        want = set(layout.names)
        problems = []
        if want - have:
            problems.append("missing " + ", ".join(sorted(want - have)))
        if have - want:
            problems.append("unexpected " + ", ".join(sorted(have - want)))
        for spec in layout:
            if spec.name in have and tuple(group[spec.name].shape) != spec.shape:
                problems.append(f"{spec.name} has shape {tuple(group[spec.name].shape)}, the model needs {spec.shape}")
        if problems:
            raise CheckpointError(f"weights file {path} does not fit the model: " + "; ".join(problems))
        try:
            return {spec.name: np.asarray(group[spec.name][...], dtype=np.float32) for spec in layout}
        except OSError as e:
            raise CheckpointError(f"weights file {path}: a dataset failed to read or verify ({e})") from None
