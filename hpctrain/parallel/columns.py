"""Row blocks traded for column blocks over a tensor-parallel group: how a tp rank loads a column split.

A row-parallel Linear's weight is split by columns, but a checkpoint stores a tensor one row after
another, so reading rank r's columns straight from it would make every tp rank read and hash every
row. Instead rank r reads row block r of the tensor (``row_bounds``), whole, and the group trades
(``trade_columns``): every rank gets every other rank's rows of its own columns.

Each rank sends rank q its rows of q's columns as one strided MPI datatype (no packed copy) and
receives each rank's rows of its own columns straight into their place; its own rows of its own
columns it copies itself. On 2 ranks with a 4096 x 4096 tensor that took 12.6-14.0 ms under
MPICH against 15.9-17.5 ms for one ``Alltoallw`` with the same datatypes, which also pushes the
rank's own block through MPI (bench/bench_column_trade.py, docs/performance.md).
"""

from __future__ import annotations

import numpy as np

__all__ = ["row_bounds", "start_trade", "trade_columns"]

_TAG = 0x434F  # point-to-point inside the tp group's own communicator: no other traffic shares it


def row_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """Row block r of a tensor of ``rows`` rows cut into ``parts`` (what tp rank r reads)."""
    return [(r * rows // parts, (r + 1) * rows // parts) for r in range(parts)]


def trade_columns(comm, block, out, shape) -> None:
    """Collective over ``comm``: ``block``, this rank's row block (``row_bounds``) of a float32 tensor of
    ``shape`` (rows, cols), flat, becomes ``out``, the rank's column block [rows, cols / size], flat.
    ``block`` and ``out`` must not overlap."""
    start_trade(comm, block, out, shape).wait()


class start_trade:  # noqa: N801 - used as a function that returns the trade in flight
    """``trade_columns`` begun: the messages posted and this rank's own columns copied; ``wait()`` ends it
    (collective over ``comm``, in the same order on every rank). ``block`` and ``out`` must stay untouched
    until then: a loader reads the next tensor's block into another buffer meanwhile."""

    def __init__(self, comm, block, out, shape):
        from mpi4py import MPI

        size, rank = comm.Get_size(), comm.Get_rank()
        rows, cols = shape
        if cols % size:
            raise ValueError(f"{cols} columns do not split over {size} ranks")
        c = cols // size
        bounds = row_bounds(rows, size)
        lo, hi = bounds[rank]
        if block.size != (hi - lo) * cols or out.size != rows * c:
            raise ValueError(f"trade of a {rows} x {cols} tensor: block of {block.size} values, out of {out.size}")
        if np.may_share_memory(block, out):
            raise ValueError("trade_columns: block and out overlap")
        block2d, out2d = block.reshape(hi - lo, cols), out.reshape(rows, c)
        self._requests = [comm.Irecv([out2d[a:b], MPI.FLOAT], source=q, tag=_TAG)
                          for q, (a, b) in enumerate(bounds) if q != rank and b > a]
        self._columns = MPI.FLOAT.Create_vector(hi - lo, c, cols).Commit()  # my rows, c columns of each
        self._requests += [comm.Isend([block[q * c :], 1, self._columns], dest=q, tag=_TAG)
                           for q in range(size) if q != rank and hi > lo]
        out2d[lo:hi] = block2d[:, rank * c : (rank + 1) * c]

    def wait(self) -> None:
        from mpi4py import MPI

        try:
            MPI.Request.Waitall(self._requests)
        finally:
            self._columns.Free()
