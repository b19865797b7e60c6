"""``hpctrain inspect``: what a checkpoint or weights file holds, and every problem the loaders would refuse.

    text, ok = inspect("runs/digits/ckpt-00000600.h5")   # ok: every checksum verifies, nothing refused

The loaders (checkpoint/read.py) stop at the first problem; this reads on past it and
lists them all, and it never raises on a bad file.
"""

from __future__ import annotations

import math
import os

import h5py
import numpy as np

from . import format as fmt
from .._files import H5_ERRORS, member, shown, storage_problem
from . import sharded
from .pieces import whole
from .read import get_member, read_root, read_set
from .state import check_slot_names, value_problem
from ..errors import CheckpointError
from ..params import ParamLayout

__all__ = ["inspect"]


def inspect(path: str) -> tuple[str, bool]:
    """A readable description of a checkpoint or weights file and whether every checksum verifies.

    Lists step, layout, optimizer and RNG settings, every parameter's name and
    shape, the optimizer slots, and each dataset that fails its checksum. ``ok``
    is False for any problem; files never raise here. ``hpctrain inspect PATH``.
    """
    try:
        f = fmt.open_read(path, "file")
    except CheckpointError as e:
        return f"{path}\n  problem: {e}\nresult: FAILED", False
    lines, problems = [path], []
    with f:
        try:
            _inspect_file(f, path, lines, problems)
        except H5_ERRORS as e:
            problems.append(f"the file is damaged: {shown(e)}")
        except CheckpointError as e:
            problems.append(str(e))
        except Exception as e:  # noqa: BLE001 - inspect reports, never raises: a damage nobody foresaw
            problems.append(f"the file could not be read further: {type(e).__name__}: {shown(e)}")
    problems = list(dict.fromkeys(problems))  # a shard refused for params and again for each slot: once
    for p in problems:
        lines.append(f"  problem: {p}")
    lines.append("result: OK, every checksum verifies" if not problems else f"result: FAILED ({len(problems)} problem(s))")
    return "\n".join(lines), not problems


def _inspect_file(f: h5py.File, path: str, lines: list, problems: list) -> None:
    state = _describe_root(f, path, lines, problems)
    if state is not None and state.version >= sharded.VERSION:
        _inspect_set(f, path, state, lines, problems)
        return
    try:
        params, optim = get_member(f, "params", path), get_member(f, "optim", path)
    except CheckpointError as e:
        problems.append(str(e))
        return
    if not isinstance(params, h5py.Group):
        problems.append("no /params group")
        return
    size = os.path.getsize(path)
    specs = _usable(params, size, problems)
    _describe_params(specs, state, lines, problems)
    groups = [("params", specs)] + _describe_slots(optim, specs, size, state, lines, problems)
    _verify_groups(groups, state, lines, problems)
    if state is not None:
        lines.append("config:")
        lines += [f"  {shown(line)}" for line in state.config_text.splitlines()]


def _describe_root(f: h5py.File, path: str, lines: list, problems: list):
    """The root attributes' lines; the checkpoint's state when they verify, else None (a weights-only file too)."""
    state = None
    if "format" not in f.attrs:
        lines.append("  kind: weights-only file (/params, no format attribute)")
    else:
        try:
            state = read_root(f, path)
        except CheckpointError as e:
            problems.append(str(e))
            lines.append(f"  kind: format {shown(repr(fmt.decode_attr(f.attrs['format'])))}, "
                         f"version {shown(repr(fmt.decode_attr(f.attrs.get('version'))))}")
    if state is not None:
        lay = state.layout
        lines += [f"  kind: hpctrain checkpoint, format version {fmt.decode_attr(f.attrs['version'])}, "
                  f"{fmt.DIGEST} per dataset, written by hpctrain "
                  f"{shown(fmt.decode_attr(f.attrs.get('hpctrain_version')))} "
                  f"at {shown(fmt.decode_attr(f.attrs.get('created')))}",
                  f"  step {state.step}, epoch {state.epoch}, data position {state.data_position} steps into the epoch"
                  + (f"; data fingerprint {shown(state.data_fingerprint)}" if state.data_fingerprint else ""),
                  f"  layout: world_size {lay['world_size']} = dp {lay['dp']} x pp {lay['pp']} x tp {lay['tp']}",
                  f"  optimizer: {state.optim_name}, {state.optim_step} optimizer steps",
                  "  rng: " + (", ".join(f"{k}={shown(repr(v))}" for k, v in state.rng.items()) or "none"),
                  f"  root attributes verify ({fmt.ATTRS_DIGEST}); config: {len(state.config_text.splitlines())} "
                  "lines, shown at the end"]
        if "layer_plugins" in f.attrs:  # recorded, never imported: the user loads them with --plugin
            lines.append(f"  layer plugins: {shown(fmt.decode_attr(f.attrs['layer_plugins']))} (load them with "
                         "hpctrain --plugin MODULE to sample, evaluate or resume)")
    return state


def _describe_params(specs, state, lines: list, problems: list) -> None:
    """A line per parameter tensor, with its shape and dtype (a checkpoint's must be little-endian float32)."""
    total = sum(math.prod(ds.shape) for _, ds in specs)
    lines.append(f"parameters: {len(specs)} tensors, {total:,} values ({_size(total * 4)} as float32)")
    width = max([len(n) for n, _ in specs] + [4])
    for name, ds in specs:
        lines.append(f"  {name:<{width}}  {'x'.join(map(str, ds.shape)) or 'scalar':<14} {ds.dtype}")
        if state is not None and ds.dtype != np.dtype("<f4"):  # the loaders refuse these too
            problems.append(f"{ds.name} has dtype {ds.dtype}, expected little-endian float32")
        elif ds.dtype.kind != "f":
            problems.append(f"{ds.name} has dtype {ds.dtype}, expected a float type")


def _describe_slots(optim, specs, size: int, state, lines: list, problems: list) -> list:
    """A line per optimizer slot (its tensors must match the parameters'); returns [(slot, its usable datasets)]."""
    layout = ParamLayout([(n, ds.shape) for n, ds in specs])
    groups = []
    if optim is not None and not isinstance(optim, h5py.Group):
        problems.append("/optim is not a group")
    if state is not None:
        slots = {s for s in optim.keys() if isinstance(s, str)} if isinstance(optim, h5py.Group) else set()
        try:
            check_slot_names(state.optim_name, slots, CheckpointError)
        except CheckpointError as e:
            problems.append(str(e))
    if isinstance(optim, h5py.Group):
        for slot in optim.keys():
            group, problem = member(optim, slot)
            if problem or not isinstance(group, h5py.Group):
                problems.append(f"/optim/{shown(slot)} " + (problem or "is not a group"))
                continue
            fit = fmt.fit_problems(group, layout, strict_dtype=True)
            lines.append(f"optimizer slot {slot}: " + ("same names and shapes as the parameters" if not fit
                                                      else "; ".join(fit)))
            problems += [f"/optim/{slot}: {p}" for p in fit]
            groups.append((slot, _usable(group, size, problems)))
    elif state is not None:
        lines.append("optimizer slots: none")
    return groups


def _verify_groups(groups, state, lines: list, problems: list) -> None:
    """Every dataset's checksum verified, one read each, and the count of those that verify."""
    items, kinds = [], {}
    for label, members in groups:
        for _, ds in members:
            items.append((ds.name, ds))
            kind = fmt.checksum_kind(ds)
            kinds[kind] = kinds.get(kind, 0) + 1
            if state is not None and kind != fmt.DIGEST:
                problems.append(f"{ds.name} has no {fmt.DIGEST} attribute")
    bad = 0
    for label, arr, problem in fmt.verify_datasets(items, keep=True):  # one read per dataset, not held
        if problem:
            bad += 1
            problems.append(f"{label}: {problem}")
        elif bad_value := value_problem(_slot_of(label), arr):  # the loaders refuse it too
            problems.append(f"{label}: {bad_value}")
    summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    lines.append(f"checksums: {len(items) - bad} of {len(items)} datasets verify ({summary})"
                 + (" -- datasets without a checksum are only read, not verified" if "none" in kinds else ""))


def _inspect_set(f: h5py.File, path: str, state, lines: list, problems: list) -> None:
    """A sharded checkpoint (format version 3): the tensors its index maps, its shards, every block verified."""
    params = f.get("params")
    if not isinstance(params, h5py.Group):
        problems.append("no /params group")
        return
    specs = [(n, ds.shape) for n, ds in params.items() if isinstance(ds, h5py.Dataset)]
    total = sum(math.prod(shape) for _, shape in specs)
    lines.append(f"parameters: {len(specs)} tensors, {total:,} values ({_size(total * 4)} as float32)")
    width = max([len(n) for n, _ in specs] + [4])
    lines += [f"  {name:<{width}}  {'x'.join(map(str, shape)) or 'scalar'}" for name, shape in specs]
    layout = _model_layout(state) or ParamLayout(specs)  # the model's tensors: each must be in the index
    try:
        index = sharded.open_set(path, f, state, layout)
    except CheckpointError as e:
        problems.append(str(e))
        return
    lines.append(f"optimizer slots: {', '.join(index.labels[1:]) or 'none'}")
    lines.append(f"sharded: set {index.set_id}, {len(index.shards)} shard(s) in "
                 f"{os.path.basename(os.path.dirname(index.shards[0])) if index.shards else '-'}")
    held = {}  # shard position -> [pieces, values, labels]
    for (label, _), stored in index.pieces.items():
        for piece, shard, *_ in stored:
            entry = held.setdefault(shard, [0, 0, []])
            entry[0], entry[1] = entry[0] + 1, entry[1] + piece.size
            if label not in entry[2]:
                entry[2].append(label)
    for shard, path in enumerate(index.shards):
        count, values, labels = held.get(shard, [0, 0, []])
        lines.append(f"  {os.path.basename(path)}: {count} piece(s), {_size(4 * values)} ({', '.join(labels)})")
    opened, verified = {}, 0
    try:
        for label in index.labels:
            try:
                read_set(index, label, whole(layout), np.empty(layout.size, dtype=np.float32), opened=opened)
                verified += 1
            except CheckpointError as e:
                problems.append(str(e))
    finally:
        sharded.close_all(opened)
    lines.append(f"checksums: {verified} of {len(index.labels)} buffers (params, slots) verify, every 1 MiB block "
                 "of every shard read")
    lines.append("config:")
    lines += [f"  {shown(line)}" for line in state.config_text.splitlines()]


def _model_layout(state):
    """The layout of the model the checkpoint's config describes (what a resume checks the index against), or
    None when the config does not build one here (a layer kind from a plugin not loaded)."""
    try:
        import tomllib

        from ..config import parse_config
        from ..nn import make_model

        return make_model(parse_config(tomllib.loads(state.config_text)).model).layout
    except Exception:  # noqa: BLE001 - then the index's own tensors are checked
        return None


def _usable(group: h5py.Group, size: int, problems: list) -> list[tuple[str, h5py.Dataset]]:
    """``(name, dataset)`` of the members of ``group`` that can be read; a problem for each other member."""
    found = []
    for name in group.keys():
        obj, problem = member(group, name)
        if not problem and not isinstance(obj, h5py.Dataset):
            problem = "is a group, not a dataset"
        if not problem:
            problem = storage_problem(obj, size)
        if problem:
            problems.append(f"{group.name}/{shown(name)} {problem}")
        else:
            found.append((name, obj))
    return found


def _slot_of(label: str) -> str:
    """"params" for ``/params/<name>``, the slot for ``/optim/<slot>/<name>``."""
    parts = label.split("/")
    return parts[2] if parts[1] == "optim" and len(parts) > 3 else "params"


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
