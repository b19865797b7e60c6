"""Writing checkpoints and weights files on one process: a temp file, fsync, one rename (docs/checkpoint-format.md).

    path = save_checkpoint(cfg.checkpoint.dir, state, keep=cfg.checkpoint.keep)
    save_weights("weights.h5", params)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time

import h5py
import numpy as np

from . import format as fmt
from . import sets
from .._files import h5_output, replace_file
from ..errors import CheckpointError
from ..layer_kinds import plugin_modules
from .state import CheckpointState, check_slot_names, nonfinite, value_problem

__all__ = ["save_checkpoint", "write_single_file", "save_weights", "retain", "write_root_attrs", "checked_arrays"]


def save_checkpoint(directory: str, state: CheckpointState, *, keep: int, log=None) -> str:
    """Write ``<directory>/ckpt-<step:08d>.h5`` atomically, then keep only the ``keep`` newest checkpoints.

    Returns the path. Stale temp files of killed writers are removed first. An
    existing file for the same step is replaced. Retention deletes the
    checkpoints with the lowest steps, never the one just written. Call it on
    one rank only.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
    arrays = checked_arrays(state)
    final = os.path.join(directory, fmt.checkpoint_name(state.step))
    try:
        os.makedirs(directory, exist_ok=True)
        fmt.clean_stale_temps(directory)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {final}: {e}") from None
    _write_file(final, state, arrays)
    try:
        fmt.fsync_dir(directory)
        retain(directory, keep, final, log)
    except OSError as e:
        raise CheckpointError(f"checkpoint {final} was written, but pruning old checkpoints failed: {e}") from None
    return final


def write_single_file(path: str, state: CheckpointState) -> None:
    """Write ``state`` as one self-contained checkpoint file at ``path`` (format version 2; ``hpctrain export
    --format h5``): a temp file beside it, fsync, rename, fsync of the folder."""
    arrays = checked_arrays(state)
    _write_file(path, state, arrays)
    fmt.fsync_dir(os.path.dirname(os.path.abspath(path)))


def _write_file(final: str, state: CheckpointState, arrays) -> None:
    tmp = fmt.temp_path(os.path.dirname(os.path.abspath(final)), state.step)
    try:
        with h5_output(tmp, f"cannot write checkpoint {final}", CheckpointError, libver=fmt.LIBVER) as f:
            write_root_attrs(f, state)
            f.create_group("params", track_order=True)
            optim = f.create_group("optim")
            for slot in state.slots:
                optim.create_group(slot, track_order=True)
            fmt.write_datasets(f, arrays)
        fmt.fsync_file(tmp)
        replaced = sets.owned_set_dir(final)
        replace_file(tmp, final, f"cannot write checkpoint {final}", CheckpointError)
        if replaced:  # a sharded set of the same step, now named by no index
            shutil.rmtree(replaced, ignore_errors=True)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write checkpoint {final}: {e}") from None
        raise


def checked_arrays(state: CheckpointState) -> list[tuple[str, np.ndarray]]:
    """Check a state before anything touches the disk; return ``(dataset path, array)`` in write order."""
    for key in ("step", "epoch", "data_position", "optim_step"):
        value = getattr(state, key)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"CheckpointState.{key} must be an integer >= 0, got {value!r}")
    if not isinstance(state.config_text, str):
        raise TypeError(f"CheckpointState.config_text must be a str, got {type(state.config_text).__name__}")
    if set(state.layout) != set(fmt.LAYOUT_KEYS):
        raise ValueError(f"CheckpointState.layout must have exactly the keys {', '.join(fmt.LAYOUT_KEYS)}, "
                         f"got {', '.join(map(str, state.layout)) or 'none'}")
    lay = {k: state.layout[k] for k in fmt.LAYOUT_KEYS}
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in lay.values()) \
            or lay["dp"] * lay["pp"] * lay["tp"] != lay["world_size"]:
        raise ValueError(f"CheckpointState.layout must hold integers >= 1 with dp x pp x tp = world_size, got {lay}")
    if state.optim_name not in fmt.OPTIMIZERS:
        raise ValueError(f"CheckpointState.optim_name must be one of {', '.join(fmt.OPTIMIZERS)}, got {state.optim_name!r}")
    check_slot_names(state.optim_name, set(state.slots), lambda msg: ValueError(f"CheckpointState.slots: {msg}"))
    fmt.check_rng(state.rng)
    arrays = []
    for name, arr in state.params.items():
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise ValueError(f"parameter name {name!r} cannot be an HDF5 dataset name")
        arrays.append((f"params/{name}", _float32(arr, f"params[{name!r}]")))
        problem = nonfinite(arrays[-1][1])
        if problem:  # the loaders refuse such a file: never write one over good checkpoints
            raise CheckpointError(f"step {state.step}: parameter {name} has {problem}; no checkpoint written "
                                  "(the run diverged: lower optim.lr or set train.grad_clip)")
    for slot, tensors in state.slots.items():
        if set(tensors) != set(state.params):
            diff = sorted(set(tensors) ^ set(state.params))
            raise ValueError(f"slots[{slot!r}] must have the same names as params; these differ: {', '.join(diff)}")
        for name, arr in state.params.items():
            t = _float32(tensors[name], f"slots[{slot!r}][{name!r}]")
            if t.shape != np.shape(arr):
                raise ValueError(f"slots[{slot!r}][{name!r}] has shape {t.shape}, params[{name!r}] has {np.shape(arr)}")
            problem = value_problem(slot, t)
            if problem:  # the loaders refuse it too
                raise CheckpointError(f"step {state.step}: optimizer slot {slot} of {name} has {problem}; "
                                      "no checkpoint written")
            arrays.append((f"optim/{slot}/{name}", t))
    return arrays


def _float32(arr, label: str) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype != np.float32:
        raise TypeError(f"{label} must be float32, got {arr.dtype}")
    return np.asarray(arr, dtype="<f4", order="C")  # a scalar stays one (ascontiguousarray makes it (1,))


def write_root_attrs(f: h5py.File, state: CheckpointState, version: int = fmt.SINGLE_FILE_VERSION, *,
                     extra=None) -> None:
    """The root attributes of a checkpoint (docs/checkpoint-format.md), ``extra`` among them, and their digest."""
    import hpctrain

    a = f.attrs
    values = {"format": fmt.FORMAT, "version": version, "checksum": fmt.DIGEST}
    values.update({key: int(getattr(state, key)) for key in ("step", "epoch", "data_position")})
    values["config"] = state.config_text
    values.update({key: int(state.layout[key]) for key in fmt.LAYOUT_KEYS})
    values.update(optimizer=state.optim_name, optimizer_step=int(state.optim_step))
    values.update({fmt.RNG_PREFIX + key: value for key, value in state.rng.items()})
    if state.vocabulary:
        values["vocabulary"] = json.dumps([ord(ch) for ch in state.vocabulary])
    if state.tokenizer:
        values["tokenizer"] = state.tokenizer
    if state.data_fingerprint:
        values["data_fingerprint"] = state.data_fingerprint
    plugins = plugin_modules(state.config_text)  # the modules that register the model's own layer kinds
    if plugins:
        values["layer_plugins"] = json.dumps(plugins)
    values.update(hpctrain_version=str(getattr(hpctrain, "__version__", "")),
                  created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    values.update(extra or {})
    for key, value in values.items():
        fmt.set_attr(a, key, value)
    fmt.set_attr(a, fmt.ATTRS_DIGEST, fmt.attrs_digest(a))


def retain(directory: str, keep: int, newest: str, log=None) -> None:
    """Delete the oldest checkpoints below ``newest``'s step until ``keep`` remain, whole sets; never a newer one,
    and never one whose name, step, set id and shards' folder disagree (``sets.remove_set``: one ``log`` line)."""
    found = fmt.list_checkpoints(directory)
    step = next((s for s, p in found if os.path.abspath(p) == os.path.abspath(newest)), None)
    older = []
    for s, p in found:
        if step is not None and s < step:
            if sets.owned_set(p)[1]:
                sets.remove_set(p, log)  # refuses, with its one line; it does not count towards keep
            else:
                older.append(p)
    doomed = older[: max(0, len(older) - (keep - 1))]
    for path in doomed:
        sets.remove_set(path, log)  # the index, then a sharded set's folder
    if doomed:
        fmt.fsync_dir(directory)


def save_weights(path: str, params: dict[str, np.ndarray]) -> None:
    """Write ``/params/<name>`` datasets atomically (temporary file, fsync, rename); Fletcher32 on each dataset."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{secrets.token_hex(8)}.h5")
    try:
        with h5_output(tmp, f"cannot write weights {path}", CheckpointError) as f:
            group = f.create_group("params", track_order=True)
            for name, arr in params.items():
                group.create_dataset(name, data=np.asarray(arr, dtype=np.float32), fletcher32=True)
        fmt.fsync_file(tmp)
        replace_file(tmp, path, f"cannot write weights {path}", CheckpointError)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fmt.fsync_dir(folder)
