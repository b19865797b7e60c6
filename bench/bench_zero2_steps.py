"""zero = 2 step by step: each rank's peak and resident memory after every training step.

    mpiexec -n 4 python bench/bench_zero2_steps.py            # the 50 M MLP of bench/bench_memory.py, dp 4

What showed that a backward pass outrunning the reductions held every bucket at once: the peak RSS
(``ru_maxrss``) rose above the resident size between steps (``VmRSS``) from the second step on. Prints, for
the largest rank, after each step: peak MiB, resident MiB, pooled MiB (released pages waiting for the next
backward), and the seconds the step's backward waited for earlier buckets (``GradSync.will_write``).

Figure: peak and resident memory after every zero 2 step; docs/performance.md, "ZeRO: memory and speed" (every run
behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from bench_memory import write_config  # noqa: E402
from common import synthetic_classification  # noqa: E402
from hpctrain import Trainer, load_config  # noqa: E402
from hpctrain.parallel.mesh import Mesh  # noqa: E402


def resident_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) // 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    name = np.zeros(256, dtype=np.uint8)  # rank 0's temporary folder, shared as bytes (buffer calls: no pickle)
    if comm.rank == 0:
        made = tempfile.mkdtemp(prefix="hpctrain-bench-zero2-").encode()
        name[: len(made)] = np.frombuffer(made, dtype=np.uint8)
    comm.Bcast(name, root=0)
    folder = name.tobytes().rstrip(b"\0").decode()
    try:
        if comm.rank == 0:
            synthetic_classification(os.path.join(folder, "d.h5"), 4 * args.batch, args.width, args.width)
            write_config(folder, args.width, args.batch, args.steps, 2, args.bucket_mb)
        comm.Barrier()
        mesh = Mesh()
        t = Trainer(load_config(os.path.join(folder, "zero2.toml"), ['train.metrics=""']), mesh=mesh,
                    log=lambda *a: None)
        rows = []
        for step in range(args.steps):
            t.train_step(step, 1e-4)
            pooled = t.grad_memory.pooled_bytes >> 20 if t.grad_memory is not None else 0
            rows.append((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, resident_mib(), pooled,
                         getattr(t.sync, "backpressure_seconds", 0.0)))  # (0 on trees before the wait)
        t.close()
        mesh.free()
        table = np.array(rows, dtype=np.float64)
        peaks = np.empty(comm.size, dtype=np.float64)
        comm.Allgather(table[-1:, 0].copy(), peaks)
        worst = int(np.argmax(peaks))
        comm.Bcast(table, root=worst)
        rows = [(int(a), int(b), int(c), d) for a, b, c, d in table]
        if comm.rank == 0:
            print(f"zero 2, dp {comm.size}, MLP 3 x {args.width}^2, batch {args.batch}; rank {worst} (largest peak)")
            for step, (peak, resident, pooled, waited) in enumerate(rows, 1):
                print(f"  step {step}: peak {peak} MiB, resident {resident} MiB, pooled {pooled} MiB, "
                      f"backward waited {waited * 1e3:.1f} ms")
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
