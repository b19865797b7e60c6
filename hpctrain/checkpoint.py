"""HDF5 weights files and checkpoints; docs/checkpoint-format.md describes the files.

A weights-only file is HDF5 with a group ``/params`` holding one float32
dataset per parameter, named and shaped as torch's ``state_dict()``. A
checkpoint adds root attributes (format, version, step, data position, config,
layout, optimizer, RNG settings) and the optimizer slots under
``/optim/<slot>/<name>``; every dataset carries a ``sha256`` attribute that the
loaders check.

Only one rank writes (rank 0; nothing here is collective):

    state = CheckpointState(step=..., epoch=..., data_position=..., config_text=cfg.to_toml(), ...)
    path = save_checkpoint(cfg.checkpoint.dir, state, keep=cfg.checkpoint.keep)
    state = find_resume(cfg.checkpoint.dir, model.layout, log)    # resume = "auto"; None if no checkpoint
    state = load_checkpoint(path, model.layout, optim_name="adam")

A file appears under its final name ``ckpt-<step:08d>.h5`` only once it is
complete: it is written to a hidden temp file in the same directory, fsynced,
renamed into place and the directory fsynced.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field

import h5py
import numpy as np

from . import checkpoint_format as fmt
from ._files import H5_ERRORS, member, shown
from .errors import CheckpointError, ModelMismatchError, NewerFormatError
from .params import ParamLayout

__all__ = ["CheckpointState", "save_checkpoint", "load_checkpoint", "read_meta", "find_resume", "list_checkpoints", "inspect",
           "save_weights", "load_weights"]

list_checkpoints = fmt.list_checkpoints

_H5_ERRORS = H5_ERRORS  # what h5py raises on damaged metadata or content it cannot represent


@dataclass
class CheckpointState:
    """Everything a run needs to continue, in host memory.

    ``step`` counts training steps done (the next step to run); ``epoch`` and
    ``data_position`` (steps into that epoch) say where the data order stands,
    which is a pure function of (``rng``'s seed, step). ``layout`` is
    ``{"world_size", "dp", "pp", "tp"}`` of the run that wrote it (any layout may
    load it). ``params`` and each ``slots[slot]`` map PyTorch names to full,
    unsharded float32 arrays; ``optim_step`` is the optimizer's own step count
    (skipped non-finite steps do not count). ``vocabulary``: a language model's
    characters in token-id order, or "" (stored as the optional root attribute
    ``vocabulary``, a JSON array of code points). ``path`` is set by the loaders.
    """

    step: int
    epoch: int
    data_position: int
    config_text: str
    layout: dict
    params: dict
    optim_name: str
    optim_step: int
    slots: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)
    vocabulary: str = ""
    path: str = ""


# --------------------------------------------------------------------------- writing


def save_checkpoint(directory: str, state: CheckpointState, *, keep: int) -> str:
    """Write ``<directory>/ckpt-<step:08d>.h5`` atomically, then keep only the ``keep`` newest checkpoints.

    Returns the path. Stale temp files of killed writers are removed first. An
    existing file for the same step is replaced. Retention deletes the
    checkpoints with the lowest steps, never the one just written. Call it on
    one rank only.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
    arrays = _checked_arrays(state)
    final = os.path.join(directory, fmt.checkpoint_name(state.step))
    try:
        os.makedirs(directory, exist_ok=True)
        fmt.clean_stale_temps(directory)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {final}: {e}") from None
    tmp = fmt.temp_path(directory, state.step)
    try:
        with h5py.File(tmp, "x", libver=fmt.LIBVER, locking=False) as f:
            _write_root_attrs(f, state)
            f.create_group("params", track_order=True)
            optim = f.create_group("optim")
            for slot in state.slots:
                optim.create_group(slot, track_order=True)
            fmt.write_datasets(f, arrays)
        fmt.fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write checkpoint {final}: {e}") from None
        raise
    try:
        fmt.fsync_dir(directory)
        _retain(directory, keep, final)
    except OSError as e:
        raise CheckpointError(f"checkpoint {final} was written, but pruning old checkpoints failed: {e}") from None
    return final


def _checked_arrays(state: CheckpointState) -> list[tuple[str, np.ndarray]]:
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
    _check_slot_names(state.optim_name, set(state.slots), lambda msg: ValueError(f"CheckpointState.slots: {msg}"))
    fmt.check_rng(state.rng)
    arrays = []
    for name, arr in state.params.items():
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise ValueError(f"parameter name {name!r} cannot be an HDF5 dataset name")
        arrays.append((f"params/{name}", _float32(arr, f"params[{name!r}]")))
        problem = _nonfinite(arrays[-1][1])
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
            problem = _value_problem(slot, t)
            if problem:  # the loaders refuse it too
                raise CheckpointError(f"step {state.step}: optimizer slot {slot} of {name} has {problem}; "
                                      "no checkpoint written")
            arrays.append((f"optim/{slot}/{name}", t))
    return arrays


def _float32(arr, label: str) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype != np.float32:
        raise TypeError(f"{label} must be float32, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<f4")


def _check_slot_names(optim_name: str, have: set, error):
    required, optional = fmt.OPTIMIZERS[optim_name]
    missing = [s for s in required if s not in have]
    unknown = sorted(have - set(required) - set(optional))
    if missing or unknown:
        allowed = ", ".join(required + optional) or "none"
        raise error(f"optimizer {optim_name} keeps slots {allowed}; "
                    + "; ".join(filter(None, [missing and "missing " + ", ".join(missing),
                                              unknown and "unexpected " + ", ".join(unknown)])))


def _write_root_attrs(f: h5py.File, state: CheckpointState) -> None:
    import hpctrain

    a = f.attrs
    values = {"format": fmt.FORMAT, "version": fmt.VERSION, "checksum": fmt.DIGEST}
    values.update({key: int(getattr(state, key)) for key in ("step", "epoch", "data_position")})
    values["config"] = state.config_text
    values.update({key: int(state.layout[key]) for key in fmt.LAYOUT_KEYS})
    values.update(optimizer=state.optim_name, optimizer_step=int(state.optim_step))
    values.update({fmt.RNG_PREFIX + key: value for key, value in state.rng.items()})
    if state.vocabulary:
        values["vocabulary"] = json.dumps([ord(ch) for ch in state.vocabulary])
    values.update(hpctrain_version=str(getattr(hpctrain, "__version__", "")),
                  created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    for key, value in values.items():
        fmt.set_attr(a, key, value)
    fmt.set_attr(a, fmt.ATTRS_DIGEST, fmt.attrs_digest(a))


def _retain(directory: str, keep: int, newest: str) -> None:
    """Delete the oldest checkpoints below ``newest``'s step until ``keep`` remain; never a newer one."""
    found = fmt.list_checkpoints(directory)
    step = next((s for s, p in found if os.path.abspath(p) == os.path.abspath(newest)), None)
    older = [p for s, p in found if step is not None and s < step]
    doomed = older[: max(0, len(older) - (keep - 1))]
    for path in doomed:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if doomed:
        fmt.fsync_dir(directory)


# --------------------------------------------------------------------------- reading


def load_checkpoint(path: str, layout: ParamLayout, *, optim_name: str | None = None) -> CheckpointState:
    """Read and verify a checkpoint for a model with ``layout``; any problem is a CheckpointError.

    Checks the format attribute and version, that ``/params`` and every slot hold
    exactly the layout's names and shapes in float32, the slots fit the stored
    optimizer (and ``optim_name`` when given), and every dataset's sha256.
    Opens the file read-only.
    """
    with fmt.open_read(path, "checkpoint") as f:
        try:
            state = _read_meta(f, path)
            if optim_name is not None and optim_name != state.optim_name:
                raise CheckpointError(f"checkpoint {path} holds {state.optim_name} optimizer state but the optimizer is "
                                      f"{optim_name}; to start {optim_name} from its weights, use it as checkpoint.init")
            groups = _groups(f, path, state.optim_name)
            _check_members(f"checkpoint {path}", groups, path, require_digest=True)
            _check_fit(f"checkpoint {path}", groups, layout, strict_dtype=True)
            tensors, failures = _read_groups(groups, layout)
        except _H5_ERRORS as e:
            raise CheckpointError(f"checkpoint {path} is damaged: {shown(e)}") from None
    if failures:
        raise CheckpointError(f"checkpoint {path} failed verification: " + "; ".join(failures))
    state.params = tensors.pop("params")
    state.slots = tensors
    state.path = path
    return state


def read_meta(path: str) -> CheckpointState:
    """A checkpoint's step, config text and other root attributes (verified), without its tensors."""
    with fmt.open_read(path, "checkpoint") as f:
        try:
            state = _read_meta(f, path)
        except _H5_ERRORS as e:
            raise CheckpointError(f"checkpoint {path} is damaged: {shown(e)}") from None
    state.path = path
    return state


def find_resume(directory: str, layout: ParamLayout, log, *, optim_name: str | None = None) -> CheckpointState | None:
    """The newest checkpoint in ``directory`` that verifies, for ``checkpoint.resume = "auto"``.

    Each newer one that fails is reported through ``log`` and, once an older one
    verifies, set aside as ``<name>.skipped``: kept for inspection, but out of
    the way of the resumed run, which would otherwise overwrite it on reaching
    its step (or prune it). Returns None when the directory holds no
    ``ckpt-*.h5``; raises CheckpointError when it holds some but none verifies
    (starting afresh would silently throw the run away), and at once for a
    file written by a newer hpctrain (it is probably fine: upgrade rather than
    resume from an older one).
    """
    found = fmt.list_checkpoints(directory) if directory else []
    skipped = []
    for _, path in reversed(found):
        try:
            state = load_checkpoint(path, layout, optim_name=optim_name)
        except NewerFormatError as e:
            raise NewerFormatError(f"{e}; resume = \"auto\" does not fall back past it to an older checkpoint")
        except ModelMismatchError as e:  # another model's run, not damage: an older one would not fit either
            raise ModelMismatchError(f"{e}; it was written for a different model (hpctrain inspect shows its config): "
                                     "use a new checkpoint.dir for this model") from None
        except CheckpointError as e:
            log(f"resume: skipping {os.path.basename(path)}: {e}")
            skipped.append(path)
            continue
        if skipped:
            names = ", ".join(os.path.basename(p) for p in skipped)
            log(f"resume: using {os.path.basename(path)} (step {state.step}) in {directory} instead of the newer "
                f"{names}, which failed verification; they are kept as <name>.skipped")
            _set_aside(skipped)
        return state
    if skipped:
        raise CheckpointError(f"no checkpoint in {directory} verifies ({', '.join(map(os.path.basename, skipped))}; "
                              'see the log); move them away or set checkpoint.resume = "never" to start afresh')
    return None


def _set_aside(paths) -> None:
    """Rename each path to ``<path>.skipped`` (never over an existing file), so no later save or pruning touches it."""
    for path in paths:
        target, n = path + ".skipped", 1
        while os.path.exists(target):
            target, n = f"{path}.skipped-{n}", n + 1
        try:
            os.rename(path, target)
        except OSError as e:
            raise CheckpointError(f"cannot set aside {path}, which failed verification, as {target} ({e}); "
                                  "move it away by hand and resume again") from None
    if paths:
        fmt.fsync_dir(os.path.dirname(os.path.abspath(paths[0])))


def _read_meta(f: h5py.File, path: str) -> CheckpointState:
    a = f.attrs
    odd = [shown(k) for k in a.keys() if not isinstance(k, str)]
    if odd:
        raise CheckpointError(f"checkpoint {path}: root attribute name(s) {', '.join(odd)} are not UTF-8; "
                              "the file is damaged")
    if "format" not in a:
        if isinstance(f.get("params"), h5py.Group):
            raise CheckpointError(f"checkpoint {path} is a weights-only file (/params but no format attribute): "
                                  "use it as checkpoint.init")
        raise CheckpointError(f"checkpoint {path} is not an hpctrain checkpoint (no format attribute)")
    _check_format(a, path, "checkpoint")
    checksum = fmt.str_attr(a, "checksum", path)
    if checksum != fmt.DIGEST:
        raise CheckpointError(f"checkpoint {path} uses checksum {checksum!r}; this hpctrain knows {fmt.DIGEST!r}")
    optim_name = fmt.str_attr(a, "optimizer", path)
    if optim_name not in fmt.OPTIMIZERS:
        raise CheckpointError(f"checkpoint {path}: unknown optimizer {optim_name!r}")
    layout = {k: fmt.int_attr(a, k, path, minimum=1) for k in fmt.LAYOUT_KEYS}
    rng = {k[len(fmt.RNG_PREFIX):]: fmt.decode_attr(v) for k, v in a.items() if k.startswith(fmt.RNG_PREFIX)}
    bad = [k for k, v in rng.items() if v is None]
    if bad:
        raise CheckpointError(f"checkpoint {path}: rng attribute(s) {', '.join(bad)} are not scalars")
    state = CheckpointState(step=fmt.int_attr(a, "step", path), epoch=fmt.int_attr(a, "epoch", path),
                            data_position=fmt.int_attr(a, "data_position", path),
                            config_text=fmt.str_attr(a, "config", path), layout=layout, params={},
                            optim_name=optim_name, optim_step=fmt.int_attr(a, "optimizer_step", path), rng=rng)
    if fmt.str_attr(a, fmt.ATTRS_DIGEST, path) != fmt.attrs_digest(a):
        raise CheckpointError(f"checkpoint {path}: the root attributes fail their checksum ({fmt.ATTRS_DIGEST}); "
                              "the file is damaged")
    _check_counters(state, path)
    if "vocabulary" in a:
        state.vocabulary = _vocabulary(fmt.str_attr(a, "vocabulary", path), path)
    return state


def _check_counters(state: CheckpointState, path: str) -> None:
    """Counters a run could reach and keep counting from (a next save must not overflow int64), consistent."""
    for key, value in (("step", state.step), ("optimizer_step", state.optim_step)):
        if value > fmt.MAX_STEP:
            raise CheckpointError(f"checkpoint {path}: root attribute {key!r} = {value} is beyond any run "
                                  "(at most 2**62 steps); the file is damaged or forged")
    for key, value in (("epoch", state.epoch), ("data_position", state.data_position)):
        if value > state.step:  # epoch = step // steps_per_epoch, data_position = step % steps_per_epoch
            raise CheckpointError(f"checkpoint {path}: root attribute {key!r} = {value} is larger than step = "
                                  f"{state.step}; the file is damaged or forged")


def _vocabulary(text: str, path: str) -> str:
    try:
        points = json.loads(text)
        if isinstance(points, list) and all(isinstance(p, int) and 0 <= p <= 0x10FFFF for p in points):
            return "".join(map(chr, points))
    except ValueError:
        pass
    raise CheckpointError(f"checkpoint {path}: root attribute 'vocabulary' is not a JSON array of code points")


def _check_format(attrs, path: str, what: str) -> None:
    name = fmt.decode_attr(attrs["format"])
    if name != fmt.FORMAT:
        raise CheckpointError(f"{what} {path} has format attribute {shown(repr(attrs['format']))}, expected "
                              f"{fmt.FORMAT!r}")
    version = fmt.decode_attr(attrs.get("version"))
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{what} {path} has an invalid version attribute {shown(repr(attrs.get('version')))}")
    if version > fmt.VERSION:
        raise NewerFormatError(f"{what} {path} was written by a newer hpctrain (format version {version}; this "
                              f"hpctrain reads up to version {fmt.VERSION}): upgrade hpctrain to read it")


def _member(group: h5py.Group, name: str, path: str):
    """``group[name]``, or None when there is no such link; a link that cannot be followed is an error.

    ``group.get`` would answer None for a damaged object header or a dangling soft
    link too, and a damaged ``/optim`` would pass as "no optimizer state".
    """
    obj, problem = member(group, name)
    if problem:
        raise CheckpointError(f"{path}: {group.name.rstrip('/')}/{name} {problem}")
    return obj


def _check_members(what: str, groups, path: str, *, require_digest: bool) -> None:
    """One CheckpointError listing every member that is no dataset of this file (``fmt.member_problems``)."""
    size = os.path.getsize(path)
    problems = [p for _, group in groups for p in fmt.member_problems(group, size, require_digest=require_digest)]
    if problems:
        raise CheckpointError(f"{what} cannot be used: " + "; ".join(problems))


def _groups(f: h5py.File, path: str, optim_name: str) -> list[tuple[str, h5py.Group]]:
    """``[("params", group), (slot, group), ...]`` after checking the slots fit the optimizer."""
    params = _member(f, "params", path)
    if not isinstance(params, h5py.Group):
        raise CheckpointError(f"checkpoint {path} has no /params group")
    optim = _member(f, "optim", path)
    if optim is not None and not isinstance(optim, h5py.Group):
        raise CheckpointError(f"checkpoint {path}: /optim is not a group")
    slots = list(optim.keys()) if optim is not None else []
    odd = [shown(s) for s in slots if not isinstance(s, str)]
    if odd:
        raise CheckpointError(f"checkpoint {path}: /optim has member(s) whose names are not UTF-8: {', '.join(odd)}")
    _check_slot_names(optim_name, set(slots), lambda msg: CheckpointError(f"checkpoint {path}: {msg}"))
    groups = [("params", params)]
    for slot in slots:
        group = _member(optim, slot, path)
        if not isinstance(group, h5py.Group):
            raise CheckpointError(f"checkpoint {path}: /optim/{slot} is not a group")
        groups.append((slot, group))
    return groups


def _check_fit(what: str, groups, layout: ParamLayout, *, strict_dtype: bool) -> None:
    """Raise one error listing every name, shape or dtype that differs from ``layout`` (groups alike, said once)."""
    entries = {}  # problems -> group paths that have them
    for _, group in groups:
        problems = tuple(fmt.fit_problems(group, layout, strict_dtype=strict_dtype))
        if problems:
            entries.setdefault(problems, []).append(group.name)
    if entries:
        parts = [f"{', '.join(names)}: {'; '.join(problems)}" for problems, names in entries.items()]
        if all(" has dtype " in p for problems in entries for p in problems):
            # names and shapes fit: not another model's file but one hpctrain did not write as it stands,
            # so resume = "auto" may fall back to an older checkpoint
            raise CheckpointError(f"{what} holds tensors of another dtype than hpctrain writes: " + " | ".join(parts))
        raise ModelMismatchError(f"{what} does not fit the model: " + " | ".join(parts))


def _nonfinite(arr) -> str:
    """'' when every value of ``arr`` is finite, else how many are not (weights must be finite to load)."""
    finite = np.isfinite(arr)
    return "" if finite.all() else f"{finite.size - int(finite.sum())} non-finite value(s) (NaN or Inf)"


def _value_problem(label: str, arr) -> str:
    """'' when the values of a parameter (``label`` "params") or optimizer slot can be trained on, else why not."""
    problem = _nonfinite(arr)
    if not problem and label == "exp_avg_sq" and (arr < 0).any():  # a running mean of squared gradients
        problem = f"{int((arr < 0).sum())} negative value(s) (exp_avg_sq is >= 0)"
    return problem


def _read_groups(groups, layout: ParamLayout):
    items = [((label, spec.name), group[spec.name]) for label, group in groups for spec in layout]
    tensors = {label: {} for label, _ in groups}
    failures = []
    for (label, name), arr, problem in fmt.verify_datasets(items, keep=True):
        where = f"/params/{name}" if label == "params" else f"/optim/{label}/{name}"
        if not problem:
            problem = _value_problem(label, arr)
        if problem:
            failures.append(f"{where}: {problem}")
        else:
            tensors[label][name] = arr
    return tensors, failures


# --------------------------------------------------------------------------- weights files


def save_weights(path: str, params: dict[str, np.ndarray]) -> None:
    """Write ``/params/<name>`` datasets atomically (temporary file, fsync, rename); Fletcher32 on each dataset."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{secrets.token_hex(8)}.h5")
    try:
        with h5py.File(tmp, "x", locking=False) as f:
            group = f.create_group("params", track_order=True)
            for name, arr in params.items():
                group.create_dataset(name, data=np.asarray(arr, dtype=np.float32), fletcher32=True)
        fmt.fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fmt.fsync_dir(folder)


def load_weights(path: str, layout: ParamLayout) -> dict[str, np.ndarray]:
    """Read ``/params`` from a weights file or a checkpoint; names and shapes must match ``layout`` exactly.

    Datasets with a ``sha256`` attribute are verified against it (in a file with a
    ``format`` attribute, a checkpoint, every dataset must have one);
    Fletcher32-filtered ones (save_weights) by HDF5 as they are read. Any float
    dtype is accepted and converted to float32. Every dataset must keep written
    data in this file (``hpctrain/_files.py``).
    """
    with fmt.open_read(path, "weights file") as f:
        try:
            checkpoint = "format" in f.attrs
            if checkpoint:
                _check_format(f.attrs, path, "weights file")
            group = _member(f, "params", path)
            if not isinstance(group, h5py.Group):
                raise CheckpointError(f"weights file {path} has no /params group")
            _check_members(f"weights file {path}", [("params", group)], path, require_digest=checkpoint)
            _check_fit(f"weights file {path}", [("params", group)], layout, strict_dtype=False)
            tensors, failures = _read_groups([("params", group)], layout)
        except _H5_ERRORS as e:
            raise CheckpointError(f"weights file {path} is damaged: {shown(e)}") from None
    if failures:
        raise CheckpointError(f"weights file {path} failed verification: " + "; ".join(failures))
    return tensors["params"]


# --------------------------------------------------------------------------- inspect


def inspect(path: str) -> tuple[str, bool]:
    """A readable description of a checkpoint or weights file and whether every checksum verifies
    (``hpctrain inspect PATH``; hpctrain/checkpoint_inspect.py). Files never raise here."""
    from .checkpoint_inspect import inspect as describe

    return describe(path)
