"""The trade of a resharding load alone: row blocks of one tensor for column blocks, over every rank.

    mpiexec -n 2 python bench/bench_column_trade.py                 # a 4096 x 4096 float32 tensor
    mpiexec -n 4 python bench/bench_column_trade.py --rows 8192 --cols 2048

Rank r holds row block r (``hpctrain.parallel.columns.row_bounds``) and ends with column block r.
Timed, alternated, resident buffers, median of ``--repeat`` (each between two Barriers):
``trade_columns`` (Isend of a strided datatype, Irecv into place, the rank's own columns by numpy),
against one ``Alltoallw`` with the same datatypes, what checkpoint loads used before. Each result
is checked against the tensor's columns.

Figure: trade_columns against one Alltoallw (a resharding load's trade); docs/performance.md, "Checkpoints" (every
run behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain.parallel.columns import row_bounds, trade_columns  # noqa: E402


def alltoallw(comm, block, out, shape) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    rows, cols = shape
    c = cols // size
    bounds = row_bounds(rows, size)
    counts = [(hi - lo) * c for lo, hi in bounds]
    displs = [sum(counts[:q]) for q in range(size)]
    lo, hi = bounds[rank]
    columns = MPI.FLOAT.Create_vector(hi - lo, c, cols).Commit()
    try:
        comm.Alltoallw([block, [1] * size, [4 * q * c for q in range(size)], [columns] * size],
                       [out, counts, [4 * d for d in displs], [MPI.FLOAT] * size])
    finally:
        columns.Free()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if args.cols % size:
        sys.exit(f"--cols {args.cols} must be a multiple of the world size {size}")
    full = np.arange(args.rows * args.cols, dtype=np.float32).reshape(args.rows, args.cols)
    lo, hi = row_bounds(args.rows, size)[rank]
    c = args.cols // size
    block = np.ascontiguousarray(full[lo:hi]).reshape(-1)
    want = np.ascontiguousarray(full[:, rank * c : (rank + 1) * c]).reshape(-1)
    out = np.zeros(args.rows * c, dtype=np.float32)
    ways = {"trade_columns": trade_columns, "Alltoallw": alltoallw}
    times = {name: [] for name in ways}
    for _ in range(args.repeat):
        for name, way in ways.items():
            out[:] = 0
            comm.Barrier()
            t0 = time.perf_counter()
            way(comm, block, out, (args.rows, args.cols))
            comm.Barrier()
            times[name].append(time.perf_counter() - t0)
            if not np.array_equal(out, want):
                sys.exit(f"rank {rank}: {name} gave the wrong columns")
    if rank == 0:
        mb = args.rows * args.cols * 4 / size / 1e6
        print(f"{size} ranks, {MPI.Get_library_version().splitlines()[0].split(',')[0].strip()}: a {args.rows} x {args.cols} "
              f"float32 tensor, {mb:,.1f} MB a rank")
        for name in ways:
            print(f"{name:>14}: {statistics.median(times[name]) * 1e3:.1f} ms (min {min(times[name]) * 1e3:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
