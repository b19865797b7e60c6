"""Whole flat buffers to and from the ranks that each hold a piece of them.

Checkpoints hold full, unsharded tensors. A pipeline stage owns the contiguous slice
``[lo, hi)`` of the global flat buffer that its model part covers; under tensor
parallelism each rank of the stage holds its shard of some of those tensors
(hpctrain/shards.py), laid out in its part's local layout. One buffer (the parameters,
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
the same ``ranges`` (per stage, the ``(lo, hi)`` of each of its model chunks: one range, or
several under interleaved 1F1B, from the same partition; ``stage_ranges`` builds them) and
its own ``part``. A stage of several chunks holds their slices one after another; the slices
then travel in stage order and rank 0 puts each in its place.
"""

from __future__ import annotations

import numpy as np

from ..shards import shard, shard_shape, unshard

__all__ = ["gather_flat", "scatter_flat", "gather_shards", "stage_ranges"]


def stage_ranges(model, stages, pp: int) -> list[list[tuple[int, int]]]:
    """Per pipeline stage, the global flat range of each of its model chunks (``stages``: the virtual stages'
    layer ranges, stage s holding ``stages[s::pp]``)."""
    return [[model.part(lo, hi).global_range for lo, hi in stages[s::pp]] for s in range(pp)]


def _in_place(ranges) -> bool:
    """Whether every stage is one slice: MPI then moves each straight into (or out of) its place."""
    return all(len(r) == 1 for r in ranges)


def _counts(ranges):
    """Gatherv/Scatterv counts and displacements over the pipeline group: each stage's slice in place, or, for
    stages of several chunks, their slices one after another in stage order."""
    counts = [sum(hi - lo for lo, hi in r) for r in ranges]
    if _in_place(ranges):
        return counts, [r[0][0] for r in ranges]
    return counts, [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]


def _stage_order(ranges):
    """(global lo, global hi, position in the stage-ordered buffer) of every chunk, stage by stage."""
    out, at = [], 0
    for r in ranges:
        for lo, hi in r:
            out.append((lo, hi, at))
            at += hi - lo
    return out


def _position(part, offset: int) -> int:
    """Where global offset ``offset`` (inside one of the part's chunks) lies in the stage's slices, one after
    another."""
    at = 0
    for lo, hi in part.global_ranges:
        if lo <= offset < hi or (offset == hi == lo):
            return at + offset - lo
        at += hi - lo
    raise ValueError(f"offset {offset} lies in none of the part's chunks {part.global_ranges}")


def _owned(part):
    """(local spec, global spec) of each tensor the part owns (a tied replica is not its own)."""
    return [(s, part.spec.layout[part.global_names[s.name]]) for s in part.layout if s.offset < part.owned_size]


def _local_offsets(part, size: int):
    """[(global spec, kind, [start of its shard in tensor-parallel rank r's owned buffer for each r], [its size on
    each r])] and each rank's owned size: a rank's buffer holds the same tensors in the same order, but a row
    split may leave ranks different shares (shards.py: ``row_block``)."""
    out, at = [], [0] * size
    for s, g in _owned(part):
        kind = part.shards.get(s.name)
        sizes = [g.size if kind is None else int(np.prod(shard_shape(g.shape, kind, r, size))) for r in range(size)]
        out.append((g, kind, list(at), sizes))
        at = [a + n for a, n in zip(at, sizes)]
    return out, at


def _assemble(part, pieces: np.ndarray, size: int) -> np.ndarray:
    """The stage's slices of the global buffer from the tensor-parallel ranks' owned local buffers, one after
    another in ``pieces``."""
    out = np.empty(sum(hi - lo for lo, hi in part.global_ranges), dtype=np.float32)
    tensors, totals = _local_offsets(part, size)
    base = np.concatenate([[0], np.cumsum(totals)])
    for g, kind, starts, sizes in tensors:
        parts = [pieces[base[r] + starts[r] : base[r] + starts[r] + sizes[r]]
                 .reshape(shard_shape(g.shape, kind, r, size) if kind else g.shape) for r in range(size)]
        at = _position(part, g.offset)
        out[at : at + g.size] = (parts[0] if kind is None else unshard(parts, kind)).reshape(-1)
    return out


def _split(part, stage: np.ndarray, size: int) -> tuple[np.ndarray, list[int]]:
    """Tensor-parallel rank r's owned local buffer, cut from the stage's slices of the global buffer (one after
    another), one after another; and each one's size."""
    tensors, totals = _local_offsets(part, size)
    base = np.concatenate([[0], np.cumsum(totals)])
    out = np.empty(int(base[-1]), dtype=np.float32)
    for g, kind, starts, sizes in tensors:
        at = _position(part, g.offset)
        full = stage[at : at + g.size].reshape(g.shape)
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
        if _in_place(ranges):
            comm.Gatherv(local, [out, counts, displs, MPI.FLOAT], root=0)
            return out
        ordered = np.empty(sum(counts), dtype=np.float32)  # model chunks: in stage order, then each to its place
        comm.Gatherv(local, [ordered, counts, displs, MPI.FLOAT], root=0)
        for lo, hi, at in _stage_order(ranges):
            out[lo:hi] = ordered[at : at + hi - lo]
        return out
    comm.Gatherv(local, None, root=0)
    return None


def scatter_flat(mesh, full: np.ndarray | None, ranges, part, *, out=None) -> np.ndarray:
    """This rank's owned part (``part.owned_size`` values) of ``full`` (given on world rank 0 only), on every
    rank, in ``out`` when given (collective over the mesh)."""
    from mpi4py import MPI

    size = sum(hi - lo for lo, hi in ranges[mesh.pp_rank])
    local = np.empty(part.owned_size, dtype=np.float32) if out is None else out
    if mesh.dp_rank == 0:
        stage = np.empty(size, dtype=np.float32) if mesh.tp > 1 else local
        if mesh.tp_rank == 0:
            comm = mesh.pp_comm
            counts, displs = _counts(ranges)
            send = None
            if comm.Get_rank() == 0:
                full = np.ascontiguousarray(full, dtype=np.float32)
                if not _in_place(ranges):  # model chunks: each stage's slices one after another
                    full = np.concatenate([full[lo:hi] for lo, hi, _ in _stage_order(ranges)])
                send = [full, counts, displs, MPI.FLOAT]
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
