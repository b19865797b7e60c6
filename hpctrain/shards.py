"""How a full tensor is cut across the ``size`` ranks of a tensor-parallel group, and put back together.

Pure numpy, below nn/, parallel/ and checkpoint/ (each of them asks it; it asks none of them): the layers cut
their shard of each tensor initialised whole from the seed (nn/model.py, nn/gpt.py), the checkpoint reads the
rows a rank holds (checkpoint/pieces.py), and parallel/sharding.py gathers and scatters full tensors with it.
The kinds (``SHARD_KINDS``): ``rows`` (a column-parallel weight and its bias, the vocabulary's rows, which may
be cut unevenly), ``rows3`` (the fused q/k/v weight: each of its three blocks of rows cut, so attention heads
stay whole) and ``cols`` (a row-parallel weight). Rank ``r`` keeps piece ``r``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SHARD_KINDS", "row_block", "shard_shape", "shard", "unshard"]

# how a full tensor is cut across the T ranks; rank r keeps piece r
SHARD_KINDS = ("rows", "rows3", "cols")  # rows3: q, k, v blocks of rows, each cut (attention heads stay whole)


def row_block(rows: int, size: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of rank ``rank``'s block when ``rows`` are cut ``size`` ways as evenly as they
    go: the first ``rows % size`` ranks keep one row more (numpy's ``array_split``). Only ``rows`` may be
    uneven (a vocabulary of 50257 over 2 ranks); ``rows3`` and ``cols`` cut heads and features that the
    model checks divide."""
    base, extra = divmod(int(rows), int(size))
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def shard_shape(shape, kind: str, rank: int, size: int) -> tuple:
    """The shape of rank ``rank``'s piece of a tensor of ``shape`` (``shard``'s, without the data)."""
    shape = tuple(int(n) for n in shape)
    if kind == "rows":
        return (row_block(shape[0], size, rank)[1],) + shape[1:]
    if kind == "rows3":
        return (shape[0] // size,) + shape[1:]
    if kind == "cols":
        return (shape[0], shape[1] // size) + shape[2:]
    raise ValueError(kind)


def shard(full: np.ndarray, kind: str, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s piece of ``full`` (a contiguous copy)."""
    if kind == "rows":
        first, count = row_block(full.shape[0], size, rank)
        return np.ascontiguousarray(full[first : first + count])
    if kind == "cols":
        return np.ascontiguousarray(np.split(full, size, axis=1)[rank])
    if kind == "rows3":
        return np.ascontiguousarray(np.concatenate([np.split(g, size, axis=0)[rank] for g in np.split(full, 3)]))
    raise ValueError(kind)


def unshard(pieces: list[np.ndarray], kind: str) -> np.ndarray:
    """The full tensor from every rank's piece, in rank order (the inverse of ``shard``)."""
    if kind == "rows":
        return np.concatenate(pieces, axis=0)
    if kind == "cols":
        return np.concatenate(pieces, axis=1)
    if kind == "rows3":
        groups = [np.split(p, 3) for p in pieces]
        return np.concatenate([np.concatenate([g[i] for g in groups]) for i in range(3)])
    raise ValueError(kind)
