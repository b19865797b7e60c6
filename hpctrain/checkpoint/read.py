"""Reading and verifying checkpoints and weights files; ``find_resume`` for ``resume = "auto"``.

    state = find_resume(cfg.checkpoint.dir, model.layout, log)    # None if the folder holds no checkpoint
    state = load_checkpoint(path, model.layout, optim_name="adam")
    weights = load_weights(cfg.checkpoint.init, model.layout)

Every check raises CheckpointError naming the file and the problem (docs/checkpoint-format.md
lists them in order); files are opened read-only, so a failing load changes nothing on disk.
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np

from . import format as fmt
from . import sharded
from .._files import H5_ERRORS, member, shown
from ..errors import CheckpointError, ModelMismatchError, NewerFormatError
from ..params import ParamLayout
from .pieces import whole
from .state import CheckpointState, check_slot_names, value_problem

__all__ = ["load_checkpoint", "read_meta", "find_resume", "load_weights", "read_root", "check_format", "get_member",
           "open_sharded", "read_set", "set_aside"]


def load_checkpoint(path: str, layout: ParamLayout, *, optim_name: str | None = None) -> CheckpointState:
    """Read and verify a checkpoint for a model with ``layout``; any problem is a CheckpointError.

    Checks the format attribute and version, that ``/params`` and every slot hold
    exactly the layout's names and shapes in float32, the slots fit the stored
    optimizer (and ``optim_name`` when given), and every dataset's sha256.
    Opens the file read-only.
    """
    index = open_sharded(path, layout, optim_name=optim_name)
    if index is not None:  # a sharded set: every tensor, whole, from the shards
        return _read_whole_set(index, layout)
    with fmt.open_read(path, "checkpoint") as f:
        try:
            state = read_root(f, path)
            _check_optimizer(state, optim_name, path)
            groups = _groups(f, path, state.optim_name)
            _check_members(f"checkpoint {path}", groups, path, require_digest=True)
            _check_fit(f"checkpoint {path}", groups, layout, strict_dtype=True)
            tensors, failures = _read_groups(groups, layout)
        except H5_ERRORS as e:
            raise CheckpointError(f"checkpoint {path} is damaged: {shown(e)}") from None
    if failures:
        raise CheckpointError(f"checkpoint {path} failed verification: " + "; ".join(failures))
    state.params = tensors.pop("params")
    state.slots = tensors
    state.path = path
    return state


def _check_optimizer(state, optim_name, path) -> None:
    if optim_name is not None and optim_name != state.optim_name:
        raise CheckpointError(f"checkpoint {path} holds {state.optim_name} optimizer state but the optimizer is "
                              f"{optim_name}; to start {optim_name} from its weights, use it as checkpoint.init")


def open_sharded(path: str, layout: ParamLayout, *, optim_name: str | None = None):
    """A sharded checkpoint's verified index (``sharded.SetIndex``; its ``state`` holds the root attributes, no
    tensors) after checking it fits ``layout``; None for a single-file checkpoint (version 2 or older)."""
    with fmt.open_read(path, "checkpoint") as f:
        try:
            state = read_root(f, path)
            if state.version < sharded.VERSION:
                return None
            _check_optimizer(state, optim_name, path)
            groups = _groups(f, path, state.optim_name)
            _check_fit(f"checkpoint {path}", groups, layout, strict_dtype=True)
            index = sharded.open_set(path, f, state, layout)
        except H5_ERRORS as e:
            raise CheckpointError(f"checkpoint {path} is damaged: {shown(e)}") from None
    state.path = path
    return index


def read_set(index, label: str, wanted, out, *, opened=None) -> None:
    """``sharded.read_pieces`` and the values check: parameters and slots finite, ``exp_avg_sq`` >= 0."""
    sharded.read_pieces(index, label, wanted, out, opened=opened)
    for w in wanted:
        problem = value_problem(label, out[w.at : w.at + w.size])
        if problem:
            where = f"/params/{w.name}" if label == "params" else f"/optim/{label}/{w.name}"
            raise CheckpointError(f"checkpoint {index.path} failed verification: {where}: {problem}")


def _read_whole_set(index, layout: ParamLayout) -> CheckpointState:
    state, tensors, opened = index.state, {}, {}
    try:
        for label in index.labels:
            out = np.empty(layout.size, dtype=np.float32)
            read_set(index, label, whole(layout), out, opened=opened)
            tensors[label] = layout.unpack(out)
    finally:
        sharded.close_all(opened)
    state.params = tensors.pop("params")
    state.slots = tensors
    return state


def read_meta(path: str) -> CheckpointState:
    """A checkpoint's step, config text and other root attributes (verified), without its tensors."""
    with fmt.open_read(path, "checkpoint") as f:
        try:
            state = read_root(f, path)
        except H5_ERRORS as e:
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
            set_aside(skipped)
        return state
    if skipped:
        raise CheckpointError(f"no checkpoint in {directory} verifies ({', '.join(map(os.path.basename, skipped))}; "
                              'see the log); move them away or set checkpoint.resume = "never" to start afresh')
    return None


def set_aside(paths) -> None:
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


def read_root(f: h5py.File, path: str) -> CheckpointState:
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
    check_format(a, path, "checkpoint")
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
    state.version = fmt.int_attr(a, "version", path, minimum=1)
    _check_counters(state, path)
    if "vocabulary" in a:
        state.vocabulary = _vocabulary(fmt.str_attr(a, "vocabulary", path), path)
    if "data_fingerprint" in a:
        state.data_fingerprint = fmt.str_attr(a, "data_fingerprint", path)
    if "tokenizer" in a:
        state.tokenizer = fmt.str_attr(a, "tokenizer", path)
    return state


def _check_counters(state: CheckpointState, path: str) -> None:
    """Counters a run could reach and keep counting from (a next save must not overflow int64), consistent."""
    for key, value in (("step", state.step), ("optimizer_step", state.optim_step)):
        if value > fmt.MAX_STEP:
            raise CheckpointError(f"checkpoint {path}: root attribute {key!r} = {value} is beyond any run "
                                  "(at most 2**62 steps); the file is damaged or forged")
    if state.epoch > state.step:  # every epoch took at least one step
        raise CheckpointError(f"checkpoint {path}: root attribute 'epoch' = {state.epoch} is larger than step = "
                              f"{state.step}; the file is damaged or forged")
    if state.data_position > fmt.MAX_STEP:  # steps of the last batch size: more than step after a smaller batch
        raise CheckpointError(f"checkpoint {path}: root attribute 'data_position' = {state.data_position} is beyond "
                              "any run; the file is damaged or forged")


def _vocabulary(text: str, path: str) -> str:
    try:
        points = json.loads(text)
        if isinstance(points, list) and all(isinstance(p, int) and 0 <= p <= 0x10FFFF for p in points):
            return "".join(map(chr, points))
    except ValueError:
        pass
    raise CheckpointError(f"checkpoint {path}: root attribute 'vocabulary' is not a JSON array of code points")


def check_format(attrs, path: str, what: str) -> None:
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


def get_member(group: h5py.Group, name: str, path: str):
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
    params = get_member(f, "params", path)
    if not isinstance(params, h5py.Group):
        raise CheckpointError(f"checkpoint {path} has no /params group")
    optim = get_member(f, "optim", path)
    if optim is not None and not isinstance(optim, h5py.Group):
        raise CheckpointError(f"checkpoint {path}: /optim is not a group")
    slots = list(optim.keys()) if optim is not None else []
    odd = [shown(s) for s in slots if not isinstance(s, str)]
    if odd:
        raise CheckpointError(f"checkpoint {path}: /optim has member(s) whose names are not UTF-8: {', '.join(odd)}")
    check_slot_names(optim_name, set(slots), lambda msg: CheckpointError(f"checkpoint {path}: {msg}"))
    groups = [("params", params)]
    for slot in slots:
        group = get_member(optim, slot, path)
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


def _read_groups(groups, layout: ParamLayout):
    items = [((label, spec.name), group[spec.name]) for label, group in groups for spec in layout]
    tensors = {label: {} for label, _ in groups}
    failures = []
    for (label, name), arr, problem in fmt.verify_datasets(items, keep=True):
        where = f"/params/{name}" if label == "params" else f"/optim/{label}/{name}"
        if not problem:
            problem = value_problem(label, arr)
        if problem:
            failures.append(f"{where}: {problem}")
        else:
            tensors[label][name] = arr
    return tensors, failures


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
            version = fmt.decode_attr(f.attrs.get("version")) if checkpoint else None
        except H5_ERRORS as e:
            raise CheckpointError(f"weights file {path} is damaged: {shown(e)}") from None
    if isinstance(version, int) and version >= sharded.VERSION:  # a sharded checkpoint's parameters
        index = open_sharded(path, layout)
        out = np.empty(layout.size, dtype=np.float32)
        read_set(index, "params", whole(layout), out)
        return layout.unpack(out)
    with fmt.open_read(path, "weights file") as f:
        try:
            if checkpoint:
                check_format(f.attrs, path, "weights file")
            group = get_member(f, "params", path)
            if not isinstance(group, h5py.Group):
                raise CheckpointError(f"weights file {path} has no /params group")
            _check_members(f"weights file {path}", [("params", group)], path, require_digest=checkpoint)
            _check_fit(f"weights file {path}", [("params", group)], layout, strict_dtype=False)
            tensors, failures = _read_groups([("params", group)], layout)
        except H5_ERRORS as e:
            raise CheckpointError(f"weights file {path} is damaged: {shown(e)}") from None
    if failures:
        raise CheckpointError(f"weights file {path} failed verification: " + "; ".join(failures))
    return tensors["params"]
