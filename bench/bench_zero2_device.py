"""zero = 2 on a GPU: the device memory it gives back against zero = 1, and what that costs a step.

    python bench/bench_zero2_device.py                  # dp 2 on one GPU: MLP 64-4096-4096-4096-10, AdamW, batch 64
    python bench/bench_zero2_device.py --width 2048 --steps 6

Each zero setting runs as its own job (``mpiexec -n 2 python bench/bench_zero2_device.py --worker --zero Z``), so
neither inherits the other's cached device memory. Both ranks share the GPU; after the last step, with both ranks
at a barrier, rank 0 reads the device's used memory (cuMemGetInfo: both processes, the CUDA contexts included).
Each rank reports the gradient buffer's device memory (the VMM mappings of backend/cuda/vmm.py's ReleasableDevice,
or the whole buffer) and what hpctrain says its gradients hold (train/memory.py). Step time: the median over the
steps after the first two, the host waiting for the step's end; with it, the host time of the buffer's driver calls
(both threads) and the last step's wait of the backward for earlier buckets' reductions (zero 2's backpressure). Staged through host memory
(parallel.cuda_aware = false): the pip MPICH is not CUDA-aware. MB here is 2^20 bytes.

Figure: zero 2 against zero 1 on a GPU: device memory and step time; docs/performance.md, "zero 2 on a GPU" (every
run behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def worker(args) -> None:
    from mpi4py import MPI
    from numba import cuda

    from common import mlp_config, shared_tempdir, synthetic_classification
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer
    from hpctrain.train.memory import rank_memory

    comm = MPI.COMM_WORLD
    folder = shared_tempdir(comm)
    path = os.path.join(folder, "d.h5")
    if comm.rank == 0:
        synthetic_classification(path, n=4 * args.batch, features=64, classes=10)
    comm.Barrier()
    cfg = mlp_config(path, [64, args.width, args.width, args.width, 10], args.batch, optim="adamw", backend="cuda")
    import dataclasses

    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=args.zero, cuda_aware=False,
                                                                bucket_mb=args.bucket_mb))
    lines = []
    mesh = Mesh()
    trainer = Trainer(cfg, mesh=mesh, log=lines.append)
    times, vmm = [], []
    mem = trainer.grad_memory
    for step in range(args.steps):
        t0 = time.perf_counter()
        before = mem.driver_seconds if mem is not None else 0.0
        trainer.train_step(step, 1e-4)
        trainer.be.synchronize()
        times.append(time.perf_counter() - t0)
        vmm.append((mem.driver_seconds if mem is not None else 0.0) - before)
    comm.Barrier()
    used = None
    if comm.rank == 0:
        free, total = cuda.current_context().get_memory_info()
        used = total - free
    row = {"rank": comm.rank, "zero": args.zero, "step_ms": statistics.median(times[2:]) * 1e3,
           "vmm_ms": statistics.median(vmm[2:]) * 1e3,
           "backpressure_ms": getattr(trainer.sync, "backpressure_seconds", 0.0) * 1e3,
           "grads_device_mb": (mem.mapped_bytes if mem is not None else 4 * trainer.params.layout.size) / 2**20,
           "grads_said_mb": rank_memory(trainer, 0).grads_bytes / 2**20,
           "full_grads_mb": 4 * trainer.params.layout.size / 2**20,
           "released_mb": trainer.sync.released_bytes / 2**20, "device_used_mb": used and used / 2**20,
           "log": next((line for line in lines if line.startswith("zero")), "")}
    rows = comm.gather(row, root=0)
    comm.Barrier()
    trainer.close()
    mesh.free()
    if comm.rank == 0:
        print(json.dumps(rows))
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--zero", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    mpiexec = shutil.which("mpiexec") or sys.exit("mpiexec not found")
    results = {}
    for zero in (1, 2):
        cmd = [mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__), "--worker", "--zero", str(zero),
               "--width", str(args.width), "--batch", str(args.batch), "--steps", str(args.steps),
               "--bucket-mb", str(args.bucket_mb)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return 1
        results[zero] = json.loads(proc.stdout.strip().splitlines()[-1])
    for zero, rows in results.items():
        print(f"zero {zero}: {rows[0]['log']}")
        for r in rows:
            print(f"  rank {r['rank']}: step {r['step_ms']:.2f} ms; gradient buffer on the device "
                  f"{r['grads_device_mb']:.1f} MB of {r['full_grads_mb']:.1f} (hpctrain's figure {r['grads_said_mb']:.1f}; "
                  f"released in the last step {r['released_mb']:.1f}); in the driver's memory calls "
                  f"{r['vmm_ms']:.1f} ms a step, the backward waiting for reductions {r['backpressure_ms']:.1f} ms")
        print(f"  device memory used by both ranks after the last step: {rows[0]['device_used_mb']:.0f} MB")
    one, two = results[1], results[2]
    print(f"zero 2 against zero 1: device memory {two[0]['device_used_mb'] - one[0]['device_used_mb']:+.0f} MB "
          f"(gradient buffers {sum(r['grads_device_mb'] for r in two) - sum(r['grads_device_mb'] for r in one):+.1f} MB);"
          f" step time {statistics.mean(r['step_ms'] for r in two) / statistics.mean(r['step_ms'] for r in one):.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
