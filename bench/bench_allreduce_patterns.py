"""How MPI moves one gradient buffer: one Allreduce, bucket-sized pieces, nonblocking variants.

    mpiexec -n 2 python bench/bench_allreduce_patterns.py              # 100 MB in 4 buckets
    mpiexec -n 2 python bench/bench_allreduce_patterns.py --mb 40 --buckets 10

The figures behind GradSync's design (hpctrain/parallel/data_parallel.py): several large
Iallreduces in flight at once against one at a time and against blocking pieces. Each
pattern is timed as the median of --repeat rounds after a Barrier, in the same run.

Figure: one Allreduce against bucket-sized pieces and nonblocking variants (GradSync's design);
docs/performance.md, "Data parallel" (every run behind it: docs/performance-log.md).
"""

import argparse
import time

import hpctrain  # noqa: F401  (first: it shares the cores between ranks before numpy starts BLAS threads)
import numpy as np
from mpi4py import MPI


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=100)
    p.add_argument("--buckets", type=int, default=4)
    p.add_argument("--repeat", type=int, default=7)
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    n = int(a.mb * 1e6 / 4)
    buf = np.ones(n, dtype=np.float32)
    cuts = [(i * n // a.buckets, (i + 1) * n // a.buckets) for i in range(a.buckets)]

    def one():
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def pieces():
        for lo, hi in cuts:
            comm.Allreduce(MPI.IN_PLACE, buf[lo:hi], op=MPI.SUM)

    def all_in_flight():
        MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, buf[lo:hi], op=MPI.SUM) for lo, hi in cuts])

    def one_in_flight():
        for lo, hi in cuts:
            comm.Iallreduce(MPI.IN_PLACE, buf[lo:hi], op=MPI.SUM).Wait()

    patterns = [("one Allreduce", one), ("blocking pieces", pieces), ("all Iallreduce in flight", all_in_flight),
                ("one Iallreduce at a time", one_in_flight)]
    results = {}
    for name, fn in patterns:
        times = []
        for _ in range(a.repeat):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        results[name] = float(np.median(times))
    if comm.rank == 0:
        print(f"{MPI.Get_library_version().splitlines()[0].strip()}, {comm.size} ranks, {a.mb:g} MB in "
              f"{a.buckets} pieces")
        base = results["one Allreduce"]
        for name, t in results.items():
            print(f"  {name:26s} {n * 4 / t / 1e9:6.2f} GB/s   ({base / t:.2f}x one Allreduce)")


if __name__ == "__main__":
    main()
