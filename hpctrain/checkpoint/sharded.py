"""Sharded checkpoints (format version 3): every rank writes its own shard, one index names the set.

On disk, for step 1500 (docs/checkpoint-format.md, "Sharded checkpoints"):

    ckpt-00001500.h5                          the index: root attributes, /manifest, and /params/<name>,
                                              /optim/<slot>/<name> as HDF5 virtual datasets over the shards
    ckpt-00001500.<set id>.shards/rank-00003.h5   world rank 3's pieces (checkpoint/pieces.py), if it holds any

The shards are written first, each by its rank (``write_shard``), into a folder no index names
yet; world rank 0 then writes the index under a temp name and renames it into place
(``write_index``): that rename commits the set. A set folder that no index names is a save that
never finished, and the next save removes it (checkpoint/sets.py). A shard is two datasets,
``/values`` (its pieces one after another) and ``/sha256_blocks`` (the SHA-256 of each 1 MiB block
of each piece), so a rank that reads part of a piece verifies just the blocks it reads. The set id
in every shard and in the index ties them together.

    index = open_set(path, f, state, layout)           # the open index's manifest, checked against the model
    read_pieces(index, "params", wanted, out)          # this rank's pieces of any layout into ``out``, verified

Nothing here talks to MPI: train/checkpointing.py runs it on every rank and agrees on the outcome.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

from . import format as fmt
from .._files import H5_ERRORS, h5_output, regular_file, replace_file, shown, storage_problem
from ..errors import CheckpointError
from .pieces import Piece, local_matrix, matches, segments, strided
from .sets import SET_ID_RE, SET_RE, SHARD_RE, set_dir_name

__all__ = ["SHARD_FORMAT", "BLOCK", "write_shard", "write_index", "open_set", "read_pieces", "close_all",
           "shard_entries", "SetIndex"]

SHARD_FORMAT = "hpctrain-checkpoint-shard"
VERSION = 3
BLOCK = 1 << 18  # float32 values per digest block: 1 MiB
INDEX_LIBVER = ("v110", "v110")  # virtual datasets need the HDF5 1.10 file format


# --------------------------------------------------------------------------- writing


def _blocks(n: int) -> int:
    """Digest blocks of a piece of ``n`` values (at least one, so an empty piece still has its entry)."""
    return max(1, -(-n // BLOCK))


def _block_digests(values: np.ndarray, out: np.ndarray) -> None:
    flat = values.reshape(-1).view(np.uint8)
    step = BLOCK * 4
    for i in range(out.shape[0]):
        out[i] = np.frombuffer(hashlib.sha256(memoryview(flat[i * step : (i + 1) * step])).digest(), np.uint8)


def shard_entries(items) -> list[list]:
    """Manifest entries ``[label, name, kind, tp_rank, tp, lo, hi, offset, first block]`` of ``items``
    ``(label, piece)`` in one shard: the pieces one after another in its ``/values``, each with its own
    digest blocks in ``/sha256_blocks``."""
    entries, at, block = [], 0, 0
    for label, p in items:
        entries.append([label, p.name, p.kind, p.tp_rank, p.tp, p.lo, p.hi, at, block])
        at, block = at + p.size, block + _blocks(p.size)
    return entries


def write_shard(path: str, *, set_id: str, rank: int, step: int, items, background: bool = False) -> None:
    """Write ``items`` ``(label, piece, values)`` to a new HDF5 file at ``path`` as ``shard_entries`` lays them
    out, and fsync it.

    h5py lays out the file with both datasets allocated (contiguous, no fill); the values then go to their
    offsets with ``os.pwrite``, which releases Python's GIL like the hashing does, one system call per piece
    however many tensors there are. In the foreground the digests are computed in threads while the values are
    written; in the ``background`` (training runs meanwhile) by the calling thread alone, one CPU's worth."""
    entries = shard_entries([(label, p) for label, p, _ in items])
    total = sum(p.size for _, p, _ in items)
    digests = np.zeros((sum(_blocks(p.size) for _, p, _ in items), 32), dtype=np.uint8)
    with h5_output(path, f"cannot write checkpoint shard {path}", CheckpointError, libver=fmt.LIBVER) as f:
        for key, value in (("format", SHARD_FORMAT), ("set_id", set_id), ("rank", rank), ("step", step)):
            fmt.set_attr(f.attrs, key, value)
        values_at = _allocate(f, "values", (total,), "<f4")
        digests_at = _allocate(f, "sha256_blocks", digests.shape, np.uint8)
    fd = os.open(path, os.O_WRONLY)
    try:
        with ThreadPoolExecutor(1 if background else fmt.workers()) as pool:
            hashing = []
            for (label, p, values), e in zip(items, entries):
                values = np.ascontiguousarray(values, dtype="<f4").reshape(-1)
                if values.size != p.size:
                    raise ValueError(f"{label} {p.name}: {values.size} values for a piece of {p.size}")
                mine = digests[e[8] : e[8] + _blocks(p.size)]
                _pwrite(fd, values, values_at + 4 * e[7])
                if background:
                    _block_digests(values, mine)
                else:
                    hashing.append(pool.submit(_block_digests, values, mine))
            for h in hashing:
                h.result()
        _pwrite(fd, digests, digests_at)
        os.fsync(fd)
    finally:
        os.close(fd)


def _allocate(f, name: str, shape, dtype) -> int:
    """A contiguous dataset allocated at creation and never filled (its values come by ``_pwrite``); its offset."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    ds = h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(np.dtype(dtype)), h5py.h5s.create_simple(shape),
                         dcpl=dcpl)
    return ds.get_offset() or 0


def _pwrite(fd: int, arr: np.ndarray, offset: int) -> None:
    """All of ``arr`` at ``offset``; then the kernel is asked to start writing it to disk now, so the disk works
    while the CPU hashes and copies the next pieces (``POSIX_FADV_DONTNEED``, only a hint: where it is missing,
    the final fsync does all the work)."""
    view = memoryview(arr.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + (1 << 26)], offset + done)
    if len(view) >= (1 << 20) and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def write_index(directory: str, state, *, set_id: str, shards: list[str], entries: list[list], layout,
                write_attrs) -> str:
    """Commit a set: write the index of ``shards`` (file names in the set folder, by position) and ``entries``
    (``shard_entries``, each with its shard's position appended) under a temp name, fsync, rename it to
    ``ckpt-<step>.h5`` and fsync the folder. ``write_attrs(f, state, version)`` writes the root attributes.
    Returns the index path; the set folder was written and fsynced before."""
    final = os.path.join(directory, fmt.checkpoint_name(state.step))
    folder = set_dir_name(state.step, set_id)
    manifest = {"set_id": set_id, "folder": folder, "shards": shards, "block": BLOCK,
                "labels": ["params"] + list(state.slots), "pieces": entries}
    text = np.frombuffer(json.dumps(manifest, separators=(",", ":")).encode("utf-8"), dtype=np.uint8)
    fmt.fsync_dir(os.path.join(directory, folder))
    tmp = fmt.temp_path(directory, state.step)
    try:
        with h5_output(tmp, f"cannot commit checkpoint {final}", CheckpointError, libver=INDEX_LIBVER) as f:
            write_attrs(f, state, VERSION, extra={"set_id": set_id, "shards": len(shards)})
            ds = f.create_dataset("manifest", data=text)
            fmt.set_attr(ds.attrs, fmt.DIGEST, hashlib.sha256(text.tobytes()).hexdigest())
            _write_virtual(f, folder, shards, entries, manifest["labels"], layout)
        fmt.fsync_file(tmp)
        replace_file(tmp, final, f"cannot commit checkpoint {final}", CheckpointError)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fmt.fsync_dir(directory)
    return final


def _virtual_maps(folder, shards, entries, labels, layout) -> dict:
    """``{(label, name): [(start, count, source, source start, values, source size)]}``: the mappings of every
    tensor of the index onto the shards' ``/values``, as the manifest's ``entries`` place its pieces. What the
    index is written with, and what ``virtual_problem`` compares an index's own mappings with."""
    by_tensor, sizes = {}, {}
    for e in entries:
        by_tensor.setdefault((e[0], e[1]), []).append(e)
        sizes[e[9]] = max(sizes.get(e[9], 0), e[7] + e[6] - e[5])
    out = {}
    for label in labels:
        for spec in layout:
            shape, maps = tuple(spec.shape), []
            for _, name, kind, tp_rank, tp, lo, hi, at, _, shard in by_tensor.get((label, spec.name), []):
                for segment in segments(Piece(name, spec.shape, kind, tp_rank, tp, lo, hi)):
                    for start, count, off, n in _virtual_boxes(shape, *segment):
                        maps.append((tuple(start), tuple(count), f"{folder}/{shards[shard]}", at + off, n,
                                     sizes[shard]))
            out[(label, spec.name)] = maps
    return out


def _write_virtual(f, folder, shards, entries, labels, layout) -> None:
    """``/params/<name>`` and ``/optim/<slot>/<name>``: full tensors mapped from the shards' ``/values``
    (h5py's low-level calls: the high-level VirtualLayout copies itself for every mapping)."""
    f.create_group("params", track_order=True)
    optim = f.create_group("optim")
    for label in labels[1:]:
        optim.create_group(label, track_order=True)
    nan = np.array(np.nan, dtype="<f4")
    maps = _virtual_maps(folder, shards, entries, labels, layout)
    for label in labels:
        group = f["params"] if label == "params" else optim[label]
        for spec in layout:
            shape = tuple(spec.shape)
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_fill_value(nan)
            for start, count, source, src_at, n, size in maps[(label, spec.name)]:
                vspace = _space(shape)
                if shape:
                    vspace.select_hyperslab(start, count)
                src = h5py.h5s.create_simple((size,))
                src.select_hyperslab((src_at,), (n,))
                dcpl.set_virtual(vspace, source.encode(), b"values", src)
            h5py.h5d.create(group.id, spec.name.encode(), h5py.h5t.IEEE_F32LE, _space(shape), dcpl=dcpl)


def _box(space) -> tuple | None:
    """(start, count) of a selection that is one box, in the dataspace's own dimensions; None otherwise."""
    kind = space.get_select_type()
    if kind == h5py.h5s.SEL_ALL:
        return (0,) * len(space.shape), tuple(space.shape)
    if kind != h5py.h5s.SEL_HYPERSLABS or not space.is_regular_hyperslab():
        return None
    start, stride, count, block = space.get_regular_hyperslab()
    if any(c > 1 and s != b for s, c, b in zip(stride, count, block)):
        return None  # gaps between the blocks: not one box
    return tuple(start), tuple(c * b for c, b in zip(count, block))


def virtual_problem(f: h5py.File, folder: str, shards: list, entries: list, labels: list, layout) -> str:
    """'' when every tensor of the index ``f`` is a virtual dataset whose sources are the set's own shard files
    (``<folder>/rank-<n>.h5``, relative: inside the set's folder beside the index) and whose mappings are exactly
    those the manifest gives; else the first problem. hpctrain reads the shards by the manifest, but a user
    reading the index with h5py (checkpoint-format.md) reads what these mappings say: another file's bytes, if
    they were re-pointed."""
    expected = _virtual_maps(folder, shards, entries, labels, layout)
    allowed = {f"{folder}/{s}" for s in shards}
    for (label, name), maps in expected.items():
        where = f"/params/{name}" if label == "params" else f"/optim/{label}/{name}"
        try:
            link = f.get(where, getlink=True)
            if not isinstance(link, h5py.HardLink):
                return f"{where} is {'missing' if link is None else 'a link'}, not a virtual dataset of the index"
            ds = f[where]
            if not isinstance(ds, h5py.Dataset) or not ds.is_virtual:
                return (f"{where} is not a virtual dataset over the set's shards (data of its own, which a reader "
                        "of the index with h5py would take for the weights)")
            got = []
            for m in ds.virtual_sources():
                source, dset = m.file_name, m.dset_name
                if source not in allowed or dset not in ("values", "/values"):
                    return (f"{where} maps {shown(source)!r}:{shown(dset)}, not /values of one of the set's own "
                            f"shards ({folder}/rank-<n>.h5): a reader of the index with h5py would read another "
                            "file's bytes")
                vbox, sbox = _box(m.vspace), _box(m.src_space)
                if vbox is None or sbox is None or len(sbox[0]) != 1:
                    return f"{where} has a virtual mapping that is not one box"
                got.append((vbox[0], vbox[1], source, sbox[0][0], sbox[1][0]))
        except H5_ERRORS as e:
            return f"{where}: its virtual dataset cannot be read, the index is damaged ({shown(e)})"
        if sorted(got) != sorted(m[:5] for m in maps):  # (HDF5 keeps a source's extent as the selection's end)
            return f"{where}: its virtual dataset's mappings are not those of the manifest"
    return ""


def _space(shape: tuple):
    """The dataspace of a tensor of ``shape``: a scalar's has no dimensions, as in the single-file format."""
    return h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)


def _virtual_boxes(shape: tuple, r: int, c: int, h: int, w: int, off: int) -> list:
    """A ``segments`` rectangle (rows r.., columns c.. of the tensor as a matrix, h × w) as (start, count,
    offset, values) hyperslabs of the tensor's own dimensions, each with its first value's piece-relative
    offset. A matrix or a vector is one; a tensor of more dimensions (held whole: its rectangles are runs of
    its C order) is cut where a run leaves an inner dimension part-way."""
    if len(shape) <= 2:
        return [((r, c)[: len(shape)], (h, w)[: len(shape)], off, h * w)]
    cols = int(np.prod(shape[1:], dtype=np.int64))
    assert h == 1 or (c == 0 and w == cols), "a tensor of more than 2 dimensions is sharded only whole"
    lo = r * cols + c
    return [(start, count, off + at - lo, int(np.prod(count))) for start, count, at in _runs(lo, lo + h * w, shape)]


def _runs(lo: int, hi: int, shape: tuple) -> list:
    """Flat C-order values [lo, hi) of a tensor of ``shape`` as boxes (start, count, flat start), in order."""
    if hi <= lo:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo)]
    inner = int(np.prod(shape[1:], dtype=np.int64))
    (r0, o0), (r1, o1) = divmod(lo, inner), divmod(hi, inner)

    def within(row, a, b):  # a part of one outer index
        return [((row,) + s, (1,) + n, row * inner + at) for s, n, at in _runs(a, b, shape[1:])]

    if r0 == r1:
        return within(r0, o0, o1)
    out = []
    if o0:
        out += within(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]), r0 * inner))
    if o1:
        out += within(r1, 0, o1)
    return out


# --------------------------------------------------------------------------- reading


class SetIndex:
    """A sharded checkpoint's index, verified: ``state`` (root attributes, no tensors), ``labels``, ``shards``
    (paths), ``pieces[(label, name)]`` -> [(Piece, shard position, offset, first block)]."""

    def __init__(self, path, state, set_id, labels, shards, pieces):
        self.path, self.state, self.set_id, self.labels = path, state, set_id, labels
        self.shards, self.pieces = shards, pieces


def open_set(path: str, f: h5py.File, state, layout) -> SetIndex:
    """Check the manifest of the open index ``f`` (its root attributes already read into ``state``) against
    ``layout``: the shards lie in the set's folder beside the index, and the pieces of every tensor and label
    cover it exactly once. Shard files themselves are checked when read."""
    set_id = fmt.str_attr(f.attrs, "set_id", path)
    if not SET_ID_RE.match(set_id):
        raise CheckpointError(f"checkpoint {path}: set_id {shown(set_id)!r} is not 16 hex digits")
    ds = f.get("manifest")
    if not isinstance(ds, h5py.Dataset) or ds.dtype != np.uint8 or ds.ndim != 1 or storage_problem(ds, os.path.getsize(path)):
        raise CheckpointError(f"checkpoint {path}: /manifest is missing or not a byte dataset of this file")
    raw = ds[()]
    stored = ds.attrs.get(fmt.DIGEST)
    stored = stored.decode("ascii", "replace") if isinstance(stored, bytes) else stored
    if hashlib.sha256(raw.tobytes()).hexdigest() != stored:
        raise CheckpointError(f"checkpoint {path}: /manifest fails its sha256; the index is damaged")
    try:
        m = json.loads(raw.tobytes().decode("utf-8"))
        folder, shards, labels, entries = m["folder"], m["shards"], m["labels"], m["pieces"]
        block = m["block"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path}: /manifest is not the JSON hpctrain writes") from None
    problem = (_manifest_problem(m, folder, shards, labels, entries, block, set_id, state)
               or _count_problem(f, path, shards, state))
    if problem:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    base = os.path.dirname(os.path.abspath(path))
    paths = [os.path.join(base, folder, s) for s in shards]
    pieces = {}
    for label, name, kind, tp_rank, tp, lo, hi, at, block, shard in entries:
        if name not in layout:
            continue  # the model check (fit) names unexpected tensors
        pieces.setdefault((label, name), []).append(
            (Piece(name, layout[name].shape, kind, tp_rank, tp, lo, hi), shard, at, block))
    for label in labels:
        for spec in layout:
            problem = _coverage_problem(pieces.get((label, spec.name), []), spec)
            if problem:
                where = f"/params/{spec.name}" if label == "params" else f"/optim/{label}/{spec.name}"
                raise CheckpointError(f"checkpoint {path}: {where} {problem}")
    problem = virtual_problem(f, folder, shards, [e for e in entries if e[1] in layout], labels, layout)
    if problem:  # what a reader of the index with h5py gets must be what the manifest says
        raise CheckpointError(f"checkpoint {path}: {problem}")
    return SetIndex(path, state, set_id, labels, paths, pieces)


def _manifest_problem(m, folder, shards, labels, entries, block, set_id, state) -> str:
    if m.get("set_id") != set_id:
        return "the manifest names another set than the index's set_id"
    if block != BLOCK:
        return f"digest blocks of {block!r} values; this hpctrain reads {BLOCK}"
    if not isinstance(folder, str) or not SET_RE.match(folder) or folder != set_dir_name(state.step, set_id):
        return (f"the shards' folder {shown(repr(folder))} is not {set_dir_name(state.step, set_id)!r} beside the "
                "index (a manifest may not point outside the checkpoint's folder)")
    if not isinstance(shards, list) or not all(isinstance(s, str) and SHARD_RE.match(s) for s in shards):
        return "the manifest's shard names are not rank-<n>.h5 (a manifest may not point outside the set's folder)"
    required, optional = fmt.OPTIMIZERS[state.optim_name]
    if not isinstance(labels, list) or labels[:1] != ["params"] or not set(required) <= set(labels[1:]) \
            or not set(labels[1:]) <= set(required + optional) or len(set(labels)) != len(labels):
        return f"the manifest's labels {shown(repr(labels))} are not params and the {state.optim_name} optimizer's slots"
    if not isinstance(entries, list):
        return "the manifest's pieces are not a list"
    for e in entries:
        ok = (isinstance(e, list) and len(e) == 10 and e[0] in labels and isinstance(e[1], str)
              and e[2] in (None, "rows", "cols", "rows3") and all(isinstance(v, int) and not isinstance(v, bool)
                                                                  for v in e[3:])
              and 0 <= e[9] < len(shards) and 0 <= e[3] < e[4] and 0 <= e[5] <= e[6] and e[7] >= 0 and e[8] >= 0)
        if not ok:
            return f"manifest entry {shown(repr(e))[:200]} is malformed"
    return ""


def _count_problem(f, path, shards, state) -> str:
    """'' when the index's ``shards`` attribute counts the manifest's shards and each is a rank of the run's
    ``world_size`` (once): the attributes and the manifest describe the same set."""
    count = fmt.int_attr(f.attrs, "shards", path)
    if count != len(shards):
        return f"its shards attribute says {count} shard(s), its manifest lists {len(shards)}"
    ranks = [int(SHARD_RE.match(s).group(1)) for s in shards]
    world = int(state.layout["world_size"])
    if len(set(ranks)) != len(ranks) or max(ranks, default=0) >= world:
        return (f"its manifest lists shards {shown(repr(shards))[:120]}, which are not distinct ranks of its "
                f"world_size {world}")
    return ""


def _coverage_problem(pieces, spec) -> str:
    """'' when ``pieces`` cover the tensor exactly once, else why not."""
    if not pieces:
        return "is in no shard"
    kinds = {(p.kind, p.tp) for p, *_ in pieces}
    if len(kinds) != 1:
        return "is split two different ways across the shards"
    (kind, tp), = kinds
    size = int(np.prod(spec.shape))
    not_allowed = f"is split {tp} ways ({kind}), which its shape {spec.shape} does not allow"
    if (kind is None) != (tp == 1) or (kind is not None and len(spec.shape) > 2):
        return not_allowed
    pers = [size] if kind is None else [int(np.prod(local_matrix(dataclasses.replace(pieces[0][0], tp_rank=r))))
                                        for r in range(tp)]
    if kind is not None and (kind != "rows" and size % tp or kind == "rows3" and (spec.shape[0] // 3) % tp
                             or kind != "cols" and spec.shape[0] < tp or sum(pers) != size):
        return not_allowed  # rows may be cut unevenly (shards.py: row_block); rows3 and cols may not
    for r, per in enumerate(pers):
        ranges = sorted((p.lo, p.hi) for p, *_ in pieces if p.tp_rank == r)
        at = 0
        for lo, hi in ranges:
            if lo != at:
                return f"has {'overlapping' if lo < at else 'missing'} values in the shards (tensor-parallel rank {r})"
            at = hi
        if at != per:
            return f"has missing or excess values in the shards (tensor-parallel rank {r})"
    return ""


def _open_shard(index: SetIndex, shard: int, opened: dict):
    """(``/values``, the digests) of shard ``shard``, checked, opened once: ``opened`` maps shard -> (file,
    values, digests) until ``close_all``."""
    if shard in opened:
        return opened[shard][1:]
    path = index.shards[shard]
    folder = os.path.dirname(path)
    if os.path.islink(folder):
        raise CheckpointError(f"the shards' folder {folder} of checkpoint {index.path} is a symbolic link; a "
                              "checkpoint's shards live in its own folder beside the index")
    regular_file(path, f"shard {path} of checkpoint {index.path}", CheckpointError, follow=False)  # never a FIFO
    f = fmt.open_read(path, "checkpoint shard")
    try:  # cached only once every check passed: a refused shard is refused again by the next read, never used
        try:
            fmt_name = fmt.decode_attr(f.attrs.get("format"))
            theirs = fmt.decode_attr(f.attrs.get("set_id"))
        except H5_ERRORS as e:
            raise CheckpointError(f"shard {path} is damaged: {shown(e)}") from None
        if fmt_name != SHARD_FORMAT:
            raise CheckpointError(f"shard {path} is not an hpctrain checkpoint shard")
        if theirs != index.set_id:
            raise CheckpointError(f"shard {path} belongs to another checkpoint (set {shown(theirs)}, the index "
                                  f"names set {index.set_id})")
        try:
            opened[shard] = (f,) + _shard_data(f, path)
        except H5_ERRORS as e:
            raise CheckpointError(f"shard {path} is damaged: {shown(e)}") from None
    except BaseException:
        f.close()
        raise
    return opened[shard][1:]


def close_all(opened: dict) -> None:
    for f, *_ in opened.values():
        f.close()
    opened.clear()


def _shard_data(f, path: str):
    """A shard's ``/values`` and its ``/sha256_blocks`` (read whole: 32 bytes a MiB), checked for storage."""
    size = os.path.getsize(path)
    out = []
    for name, dtype, ndim in (("values", "<f4", 1), ("sha256_blocks", np.uint8, 2)):
        ds = f.get(name)
        if not isinstance(ds, h5py.Dataset):
            raise CheckpointError(f"shard {path}: /{name} is missing")
        problem = storage_problem(ds, size)
        if problem:
            raise CheckpointError(f"shard {path}: /{name} {problem}")
        if ds.dtype != np.dtype(dtype) or ds.ndim != ndim or (ndim == 2 and ds.shape[1] != 32):
            raise CheckpointError(f"shard {path}: /{name} has shape {ds.shape} of {ds.dtype}, not what hpctrain writes")
        out.append(ds)
    return out[0], out[1][()]


def read_pieces(index: SetIndex, label: str, wanted: list[Piece], out: np.ndarray, *, opened=None) -> None:
    """Fill each wanted piece's values (at ``piece.at`` in the flat ``out``) from the set, reading only the
    digest blocks that hold them and verifying each block read; raises CheckpointError naming the shard."""
    own, opened = opened is None, {} if opened is None else opened
    plan = {}  # (shard, offset) -> (stored piece, first block, [(src, wanted piece, dst)])
    for w in wanted:
        for s, shard, at, block in index.pieces.get((label, w.name), []):
            for src, dst in matches(w, s):
                plan.setdefault((shard, at), (s, block, []))[2].append((src, w, dst))
    try:
        with ThreadPoolExecutor(fmt.workers()) as pool:
            for (shard, at), (s, block, moves) in plan.items():
                _read_stored(index, label, out, opened, pool, shard, at, s, block, moves)
    finally:
        if own:
            close_all(opened)


def _read_stored(index, label, out, opened, pool, shard, at, s, block, moves) -> None:
    """One stored piece's blocks that ``moves`` need: read run by run (the blocks between two ZeRO chunks
    are not read), verified, copied into the wanted pieces."""
    ds, digests = _open_shard(index, shard, opened)
    path = index.shards[shard]
    if ds.shape[0] < at + s.size or digests.shape[0] < block + _blocks(s.size):
        raise CheckpointError(f"shard {path} holds {ds.shape[0]:,} values and {digests.shape[0]:,} digest "
                              f"blocks, fewer than the manifest places in it ({label} {s.name})")
    runs = []  # [first block, end block, moves], in order, merged where they touch
    for move in sorted(moves, key=lambda m: m[0][0]):
        src = move[0]
        b0, b1 = src[0] // BLOCK, -(-(src[0] + (src[1] - 1) * src[3] + src[2]) // BLOCK)
        if runs and b0 <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], b1)
            runs[-1][2].append(move)
        else:
            runs.append([b0, b1, [move]])
    for b0, b1, run in runs:
        lo, hi = b0 * BLOCK, min(s.size, b1 * BLOCK)
        direct = None
        if len(run) == 1:
            src, w, dst = run[0]
            if (src[0], src[1] * src[2]) == (lo, hi - lo) and (src[1] == 1 or src[2] == src[3]) \
                    and (dst[1] == 1 or dst[2] == dst[3]):
                direct = out[w.at + dst[0] : w.at + dst[0] + hi - lo]  # whole blocks: straight into place
        buf = direct if direct is not None else np.empty(hi - lo, dtype=np.float32)
        try:
            if hi > lo:
                ds.read_direct(buf, np.s_[at + lo : at + hi])
        except (OSError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"shard {path}: /values ({label} {s.name}) cannot be read ({shown(e)})") from None
        checks = [(b, pool.submit(_digest, buf, (b - b0) * BLOCK, min(BLOCK, s.size - b * BLOCK)))
                  for b in range(b0, b1)]
        bad = [b for b, d in checks if d.result() != digests[block + b].tobytes()]
        if bad:
            raise CheckpointError(f"shard {path}: {label} {s.name} fails its sha256 in {len(bad)} block(s) of "
                                  f"1 MiB, the first at value {bad[0] * BLOCK:,} of the piece")
        if direct is None:
            for src, w, dst in run:
                strided(out[w.at : w.at + w.size], dst)[...] = strided(buf, (src[0] - lo,) + src[1:])


def _digest(buf: np.ndarray, at: int, n: int) -> bytes:
    return hashlib.sha256(memoryview(buf[at : at + n].view(np.uint8))).digest()
