"""Whole flat buffers to and from the stages that each hold a slice of them.

Checkpoints hold full, unsharded tensors; a pipeline stage holds the contiguous slice
``[lo, hi)`` of the global flat buffer that its model part owns. One buffer (the
parameters, or one optimizer slot) moves at a time, with buffer-based calls:

* ``gather_flat``: ``Gatherv`` over the pipeline group of data-parallel rank 0 to its
  stage 0 (world rank 0, the checkpoint writer);
* ``scatter_flat``: ``Scatterv`` from there to every stage, then ``Bcast`` over each
  stage's data-parallel group.

Both are collective over the whole mesh: every rank calls them in the same order,
with the same ``ranges`` (one ``(lo, hi)`` per stage, from the same partition).
"""

from __future__ import annotations

import numpy as np

__all__ = ["gather_flat", "scatter_flat"]


def _counts(ranges):
    return [hi - lo for lo, hi in ranges], [lo for lo, _ in ranges]


def gather_flat(mesh, local: np.ndarray, ranges, total: int) -> np.ndarray | None:
    """The global flat buffer (``total`` float32) on world rank 0, None elsewhere (collective over the mesh)."""
    from mpi4py import MPI

    if mesh.dp_rank != 0 or mesh.tp_rank != 0:
        return None  # replicas: data-parallel rank 0 speaks for them
    comm = mesh.pp_comm
    counts, displs = _counts(ranges)
    local = np.ascontiguousarray(local, dtype=np.float32)
    if comm.Get_rank() == 0:
        out = np.empty(total, dtype=np.float32)
        comm.Gatherv(local, [out, counts, displs, MPI.FLOAT], root=0)
        return out
    comm.Gatherv(local, None, root=0)
    return None


def scatter_flat(mesh, full: np.ndarray | None, ranges) -> np.ndarray:
    """This stage's slice of ``full`` (given on world rank 0 only) on every rank (collective over the mesh)."""
    from mpi4py import MPI

    lo, hi = ranges[mesh.pp_rank]
    local = np.empty(hi - lo, dtype=np.float32)
    if mesh.dp_rank == 0 and mesh.tp_rank == 0:
        comm = mesh.pp_comm
        counts, displs = _counts(ranges)
        send = [np.ascontiguousarray(full, dtype=np.float32), counts, displs, MPI.FLOAT] if comm.Get_rank() == 0 \
            else None
        comm.Scatterv(send, local, root=0)
    mesh.dp_comm.Bcast(local, root=0)
    return local
