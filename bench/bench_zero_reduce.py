"""How ZeRO can sum one gradient bucket over the data-parallel ranks: Reduce_scatter, or Allreduce and keep a chunk.

    mpiexec -n 2 python bench/bench_zero_reduce.py            # a 25 MB bucket, as parallel.bucket_mb's default
    mpirun -n 2 python bench/bench_zero_reduce.py --mb 50     # Open MPI, a bigger bucket

Each call on resident buffers, between two Barriers, alternated, median of ``--repeat`` (the first round left
out), the slowest rank's: ``Allreduce`` in place (what ``parallel.zero_reduce = "allreduce"`` runs),
``Reduce_scatter`` into each rank's chunk (``"reduce_scatter"``), ``Allgatherv`` in place (ZeRO's parameter
gather, the same either way). Then what ``"auto"`` would choose here: ``hpctrain.parallel.zero.reduce_choice``,
the start-up timing, best of 3. Both give the same bits at 2 ranks; the result of each is checked.

Figure: Reduce_scatter against Allreduce for one ZeRO bucket; docs/performance.md, "ZeRO: memory and speed" (every
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

from hpctrain.parallel.zero import reduce_choice, split_range  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=25.0, help="bucket size in MB (10^6 bytes)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = int(args.mb * 1e6 / 4)
    parts = split_range(0, n, size)
    counts, displs = [b - a for a, b in parts], [a for a, _ in parts]
    a, b = parts[rank]
    mine = np.arange(n, dtype=np.float32) % 1000 * (rank + 1)
    want = (np.arange(n, dtype=np.float32) % 1000 * (size * (size + 1) // 2))[a:b]
    buf, out = np.empty(n, np.float32), np.empty(b - a, np.float32)

    def allreduce():
        buf[:] = mine
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        t = time.perf_counter() - t0
        assert np.array_equal(buf[a:b], want)
        return t

    def reduce_scatter():
        buf[:] = mine
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Reduce_scatter(buf, out, counts, op=MPI.SUM)
        t = time.perf_counter() - t0
        assert np.array_equal(out, want)
        return t

    def allgatherv():
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allgatherv(MPI.IN_PLACE, [buf, counts, displs, MPI.FLOAT])
        return time.perf_counter() - t0

    calls = {"Allreduce": allreduce, "Reduce_scatter": reduce_scatter, "Allgatherv": allgatherv}
    times = {k: [] for k in calls}
    for r in range(args.repeat + 1):
        for name, call in calls.items():
            t = comm.allreduce(call(), op=MPI.MAX)
            if r:
                times[name].append(t)
    how, timed = reduce_choice("auto", comm, n, device=False)
    if rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
        print(f"{lib}: {size} ranks, a {args.mb:g} MB bucket, median of {args.repeat} (slowest rank)")
        for name, ts in times.items():
            low, high = min(ts) * 1e3, max(ts) * 1e3
            print(f"  {name:15s} {statistics.median(ts) * 1e3:7.2f} ms   (range {low:.2f}-{high:.2f})")
        ratio = statistics.median(times["Reduce_scatter"]) / statistics.median(times["Allreduce"])
        print(f"  Reduce_scatter / Allreduce: {ratio:.2f}")
        said = (f"{timed[0] * 1e3:.2f} vs {timed[1] * 1e3:.2f} ms at start-up" if timed
                else f"no timing at {size} ranks")
        print(f'  parallel.zero_reduce = "auto" chooses {how} ({said})')


if __name__ == "__main__":
    main()
