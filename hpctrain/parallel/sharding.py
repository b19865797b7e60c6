"""Whole flat buffers to and from the ranks that each hold a piece of them.

Checkpoints hold full, unsharded tensors. A pipeline stage owns the contiguous slice
``[lo, hi)`` of the global flat buffer that its model part covers; under tensor
parallelism each rank of the stage holds its shard of some of those tensors
(parallel/tensor.py), laid out in its part's local layout. One buffer (the parameters,
or one optimizer slot) moves at a time, with buffer-based calls:

* ``gather_flat``: on data-parallel rank 0 of each stage, ``Gatherv`` of the shards over
  the tensor-parallel group and their reassembly into the stage's slice; then
  ``Gatherv`` of the slices over the pipeline group to stage 0 (world rank 0, the
  checkpoint writer);
* ``scatter_flat``: the reverse (``Scatterv`` over the pipeline group, each stage's
  slice cut into shards and ``Scatterv``-ed over the tensor-parallel group: a row split may
  leave the ranks different shares), then
  ``Bcast`` over each stage's data-parallel group.

Both are collective over the whole mesh: every rank calls them in the same order, with
the same ``ranges`` (one ``(lo, hi)`` per stage, from the same partition) and its own
``part``.
"""

from __future__ import annotations

import numpy as np

from .tensor import shard, shard_shape, unshard

__all__ = ["gather_flat", "scatter_flat", "gather_shards"]


def _counts(ranges):
    return [hi - lo for lo, hi in ranges], [lo for lo, _ in ranges]


def _owned(part):
    """(local spec, global spec) of each tensor the part owns (a tied replica is not its own)."""
    return [(s, part.spec.layout[part.global_names[s.name]]) for s in part.layout if s.offset < part.owned_size]


def _local_offsets(part, size: int):
    """[(global spec, kind, [start of its shard in tensor-parallel rank r's owned buffer for each r], [its size on
    each r])] and each rank's owned size: a rank's buffer holds the same tensors in the same order, but a row
    split may leave ranks different shares (parallel/tensor.py: ``row_block``)."""
    out, at = [], [0] * size
    for s, g in _owned(part):
        kind = part.shards.get(s.name)
        sizes = [g.size if kind is None else int(np.prod(shard_shape(g.shape, kind, r, size))) for r in range(size)]
        out.append((g, kind, list(at), sizes))
        at = [a + n for a, n in zip(at, sizes)]
    return out, at


def _assemble(part, pieces: np.ndarray, size: int) -> np.ndarray:
    """The stage's slice of the global buffer from the tensor-parallel ranks' owned local buffers, one after
    another in ``pieces``."""
    lo = part.global_range[0]
    out = np.empty(part.global_range[1] - lo, dtype=np.float32)
    tensors, totals = _local_offsets(part, size)
    base = np.concatenate([[0], np.cumsum(totals)])
    for g, kind, starts, sizes in tensors:
        parts = [pieces[base[r] + starts[r] : base[r] + starts[r] + sizes[r]]
                 .reshape(shard_shape(g.shape, kind, r, size) if kind else g.shape) for r in range(size)]
        out[g.offset - lo : g.end - lo] = (parts[0] if kind is None else unshard(parts, kind)).reshape(-1)
    return out


def _split(part, stage: np.ndarray, size: int) -> tuple[np.ndarray, list[int]]:
    """Tensor-parallel rank r's owned local buffer, cut from the stage's slice of the global buffer, one after
    another; and each one's size."""
    lo = part.global_range[0]
    tensors, totals = _local_offsets(part, size)
    base = np.concatenate([[0], np.cumsum(totals)])
    out = np.empty(int(base[-1]), dtype=np.float32)
    for g, kind, starts, sizes in tensors:
        full = stage[g.offset - lo : g.end - lo].reshape(g.shape)
        for r in range(size):
            at = base[r] + starts[r]
            out[at : at + sizes[r]] = (full if kind is None else shard(full, kind, r, size)).reshape(-1)
    return out, totals


def _tp_counts(part, size: int) -> tuple[list[int], list[int]]:
    totals = _local_offsets(part, size)[1]
    return totals, [int(x) for x in np.concatenate([[0], np.cumsum(totals)[:-1]])]


def gather_flat(mesh, local: np.ndarray, ranges, total: int, part) -> np.ndarray | None:
    """The global flat buffer (``total`` float32) on world rank 0, None elsewhere (collective over the mesh).

    ``local``: this rank's owned part of the buffer (``part.owned_size`` values, host memory)."""
    from mpi4py import MPI

    if mesh.dp_rank != 0:
        return None  # replicas: data-parallel rank 0 speaks for them
    local = np.ascontiguousarray(local, dtype=np.float32)
    if mesh.tp > 1:
        counts, displs = _tp_counts(part, mesh.tp)
        pieces = np.empty(sum(counts), dtype=np.float32) if mesh.tp_rank == 0 else None
        mesh.tp_comm.Gatherv(local, [pieces, counts, displs, MPI.FLOAT] if mesh.tp_rank == 0 else None, root=0)
        if mesh.tp_rank != 0:
            return None
        local = _assemble(part, pieces, mesh.tp)
    comm = mesh.pp_comm
    counts, displs = _counts(ranges)
    if comm.Get_rank() == 0:
        out = np.empty(total, dtype=np.float32)
        comm.Gatherv(local, [out, counts, displs, MPI.FLOAT], root=0)
        return out
    comm.Gatherv(local, None, root=0)
    return None


def scatter_flat(mesh, full: np.ndarray | None, ranges, part, *, out=None) -> np.ndarray:
    """This rank's owned part (``part.owned_size`` values) of ``full`` (given on world rank 0 only), on every
    rank, in ``out`` when given (collective over the mesh)."""
    from mpi4py import MPI

    lo, hi = ranges[mesh.pp_rank]
    local = np.empty(part.owned_size, dtype=np.float32) if out is None else out
    if mesh.dp_rank == 0:
        stage = np.empty(hi - lo, dtype=np.float32) if mesh.tp > 1 else local
        if mesh.tp_rank == 0:
            comm = mesh.pp_comm
            counts, displs = _counts(ranges)
            send = [np.ascontiguousarray(full, dtype=np.float32), counts, displs, MPI.FLOAT] \
                if comm.Get_rank() == 0 else None
            comm.Scatterv(send, stage, root=0)
        if mesh.tp > 1:
            counts, displs = _tp_counts(part, mesh.tp)
            pieces = _split(part, stage, mesh.tp)[0] if mesh.tp_rank == 0 else None
            mesh.tp_comm.Scatterv([pieces, counts, displs, MPI.FLOAT] if mesh.tp_rank == 0 else None, local, root=0)
    mesh.dp_comm.Bcast(local, root=0)
    return local


def gather_shards(comm, local: np.ndarray, shard) -> np.ndarray | None:
    """ZeRO: the buffer from every data-parallel rank's chunks (``local``: this rank's optimizer pieces, one after
    another), on rank 0 of ``comm``, None elsewhere; one ``Gatherv`` per bucket, straight into place
    (collective over ``comm``). Beyond the shard's ``limit`` (a tied replica) ``out`` holds nothing."""
    from mpi4py import MPI

    local = np.ascontiguousarray(local, dtype=np.float32)
    root = comm.Get_rank() == 0
    out = np.empty(shard.buckets[0][1] if shard.buckets else 0, dtype=np.float32) if root else None  # cut from the end
    at = 0
    for (lo, hi), parts, (a, b) in zip(shard.buckets, shard.updated, shard.pieces):
        piece = local[at : at + b - a]
        at += b - a
        recv = [out[lo:hi], [y - x for x, y in parts], [x - lo for x, _ in parts], MPI.FLOAT] if root else None
        comm.Gatherv(piece, recv, root=0)
    return out
