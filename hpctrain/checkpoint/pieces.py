"""What each rank holds of the model's full tensors, and how to move values between two ranks' holdings.

A **piece** is a flat range ``[lo, hi)`` of one tensor as a rank holds it: the whole tensor, or
its tensor-parallel shard (``kind``, ``tp_rank`` of ``tp``; hpctrain/shards.py), and ``at`` is
where the range starts in the rank's flat buffer. ``held`` lists a rank's pieces from its model
part and its optimizer's ranges (ZeRO's chunks, parallel/zero.py), so a checkpoint writer, a
resharding reader and the memory planner read one description of what a rank holds:

    params, slots = held(part, optim.pieces)            # the parameters this rank owns; its optimizer's pieces
    for w, s, src, dst in matches(wanted, stored):      # what of stored piece s fills wanted piece w
        ...

Geometry: every tensor is seen as a matrix (a vector of n values as n x 1), and a piece as up to
three rectangles of the full tensor (``segments``): a partial first row, whole rows, a partial last
row, each cut again where a shard's rows jump (``rows3``: the q, k and v blocks). Two pieces of the
same tensor meet where their rectangles intersect; ``matches`` turns each intersection into a
strided run of the stored piece and one of the wanted piece. Nothing here talks to MPI or files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..shards import row_block

__all__ = ["Piece", "held", "written", "whole", "segments", "matches", "strided", "local_matrix"]


@dataclass(frozen=True)
class Piece:
    name: str  # the full tensor's (PyTorch) name
    shape: tuple  # the full tensor's shape
    kind: str | None  # tensor-parallel shard kind, None: the whole tensor
    tp_rank: int
    tp: int
    lo: int  # [lo, hi) of the held tensor (the shard), flat, C order
    hi: int
    at: int = 0  # where the range starts in the holder's flat buffer

    @property
    def size(self) -> int:
        return self.hi - self.lo


def _matrix(shape) -> tuple[int, int]:
    """The tensor as (rows, columns): a scalar 1 × 1, a vector a column, more dimensions (a registered layer's;
    tensor parallelism splits matrices only) the first by the product of the rest, which is their C order."""
    return (int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))) if len(shape) > 1 else \
        (int(shape[0]), 1) if shape else (1, 1)


def local_matrix(p: Piece) -> tuple[int, int]:
    """(rows, columns) of the held tensor (the shard) as a matrix."""
    rows, cols = _matrix(p.shape)
    if p.kind == "rows":
        return row_block(rows, p.tp, p.tp_rank)[1], cols
    if p.kind == "rows3":
        return rows // p.tp, cols
    if p.kind == "cols":
        return rows, cols // p.tp
    return rows, cols


def _row_blocks(p: Piece, r0: int, r1: int):
    """Held rows [r0, r1) as (held row, full row, count) runs that stay contiguous in the full tensor."""
    rows, _ = _matrix(p.shape)
    if p.kind == "rows":
        return [(r0, row_block(rows, p.tp, p.tp_rank)[0] + r0, r1 - r0)]
    if p.kind == "rows3":
        per = rows // 3 // p.tp  # held rows of one of q, k, v
        out, r = [], r0
        while r < r1:
            group, within = divmod(r, per)
            n = min(r1, (group + 1) * per) - r
            out.append((r, group * (rows // 3) + p.tp_rank * per + within, n))
            r += n
        return out
    return [(r0, r0, r1 - r0)]


def segments(p: Piece):
    """The piece as rectangles of the full tensor: ``(row, col, height, width, offset)`` with ``offset`` the
    piece-relative flat index of the rectangle's first value; inside one, rows are ``local_matrix(p)[1]``
    apart in the piece."""
    held_rows, held_cols = local_matrix(p)
    col0 = p.tp_rank * held_cols if p.kind == "cols" else 0
    out = []
    first, last = divmod(p.lo, held_cols), divmod(p.hi, held_cols)
    runs = []  # (held row, first col, height, width) in the held tensor
    if first[0] == last[0]:
        if p.hi > p.lo:
            runs.append((first[0], first[1], 1, last[1] - first[1]))
    else:
        r = first[0]
        if first[1]:
            runs.append((r, first[1], 1, held_cols - first[1]))
            r += 1
        if last[0] > r:
            runs.append((r, 0, last[0] - r, held_cols))
        if last[1]:
            runs.append((last[0], 0, 1, last[1]))
    for r, c, h, w in runs:
        for held_row, full_row, n in _row_blocks(p, r, r + h):
            out.append((full_row, col0 + c, n, w, held_row * held_cols + c - p.lo))
    assert held_rows * held_cols >= p.hi
    return out


def matches(wanted: Piece, stored: Piece):
    """Where ``stored`` holds values of ``wanted``: ``(src, dst)`` pairs of ``(start, rows, width, stride)``
    strided runs, relative to each piece's own start (same tensor, same full shape assumed)."""
    out = []
    ws, ss = local_matrix(wanted)[1], local_matrix(stored)[1]
    for sr, sc, sh, sw, soff in segments(stored):
        for wr, wc, wh, ww, woff in segments(wanted):
            r0, r1 = max(sr, wr), min(sr + sh, wr + wh)
            c0, c1 = max(sc, wc), min(sc + sw, wc + ww)
            if r0 >= r1 or c0 >= c1:
                continue
            src = (soff + (r0 - sr) * ss + (c0 - sc), r1 - r0, c1 - c0, ss)
            dst = (woff + (r0 - wr) * ws + (c0 - wc), r1 - r0, c1 - c0, ws)
            out.append((src, dst))
    return out


def strided(flat: np.ndarray, run) -> np.ndarray:
    """The ``(start, rows, width, stride)`` run of a 1-D array as a (rows, width) view (writable if ``flat`` is)."""
    start, rows, width, stride = run
    if rows == 1 or width == stride:
        return flat[start : start + rows * width].reshape(rows, width)
    base = flat[start:]
    return np.lib.stride_tricks.as_strided(base, (rows, width), (stride * flat.itemsize, flat.itemsize),
                                           writeable=flat.flags.writeable)


def whole(layout) -> list[Piece]:
    """Every tensor of a (global) layout, whole, at its offset: what a single process holds."""
    return [Piece(s.name, s.shape, None, 0, 1, 0, s.size, s.offset) for s in layout]


def held(part, optim_pieces=None) -> tuple[list[Piece], list[Piece]]:
    """(parameters, optimizer-slot pieces) a rank holds: the tensors (shards) its part owns, at their local
    offsets; and of those, the ranges its optimizer updates (``optim_pieces``: [a, b) of the part's flat
    buffer, packed one after another in the slots; default the whole owned buffer)."""
    tp_rank, tp = (part.tp.rank, part.tp.size) if part.tp is not None else (0, 1)
    glob = part.spec.layout
    params = []
    for s in part.layout:
        if s.offset >= part.owned_size:
            break  # a tied tensor's replica: its owner holds it
        name = part.global_names[s.name]
        kind = part.shards.get(s.name)
        params.append(Piece(name, glob[name].shape, kind, tp_rank if kind else 0, tp if kind else 1, 0, s.size,
                            s.offset))
    ranges = [(0, part.owned_size)] if optim_pieces is None else optim_pieces
    slots, at = [], 0
    for a, b in ranges:
        for p in params:
            lo, hi = max(a, p.at), min(b, p.at + p.size)
            if lo < hi:
                slots.append(Piece(p.name, p.shape, p.kind, p.tp_rank, p.tp, lo - p.at, hi - p.at, at + lo - a))
        at += b - a
    return params, slots


def written(part, optim_pieces, *, dp_rank: int, sharded_optimizer: bool, slots) -> list[tuple[str, Piece]]:
    """``(label, piece)`` a rank writes to a checkpoint: what no other rank writes. Parameters on data-parallel
    rank 0 (a tensor every tensor-parallel rank holds whole: tensor-parallel rank 0's); each of ``slots``'
    pieces on whoever updates them (``sharded_optimizer``: ZeRO, every data-parallel rank its chunks)."""
    tp_rank = part.tp.rank if part.tp is not None else 0
    params, mine = held(part, optim_pieces)
    once = [p for p in params if p.kind is not None or tp_rank == 0]
    out = [("params", p) for p in once] if dp_rank == 0 else []
    if sharded_optimizer or dp_rank == 0:
        out += [(label, p) for label in slots for p in mine if p.kind is not None or tp_rank == 0]
    return out
