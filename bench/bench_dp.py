"""Data-parallel gradient sync: bucketed sync efficiency and overlap with backward.

    mpiexec -n 2 python bench/bench_dp.py
    mpiexec -n 2 python bench/bench_dp.py --sync-mb 100 --bucket-mb 25

1. Sync efficiency: bytes/s of hpctrain's bucketed sync (GradSync: Iallreduce per bucket, then
   Waitall) over a flat gradient buffer of --sync-mb megabytes, against one bare
   ``MPI.Allreduce`` on the same bytes, interleaved in the same run. Target >= 0.90. The same sync
   with ``parallel.reduce_dtype = "bf16"`` (half the bytes, rounded and summed on the host by a
   user-defined operator) is timed in the same loop: its time over the float32 sync's.
2. Overlap: step time of a model whose gradient sync is a large part of the step (a wide MLP
   at a small batch), with overlap on and off. hidden = (T_off - T_on) / T_comm, where T_comm
   is the Allreduce time of the off runs. Target: hidden >= 0.5.

Figure: bucketed sync / bare Allreduce, and the share of the sync hidden by overlap; docs/performance.md, "Data
parallel" (every run behind it: docs/performance-log.md).
"""

import argparse
import dataclasses
import os
import shutil
import sys
import time

import hpctrain  # noqa: F401  (first: it shares the cores between ranks before numpy starts BLAS threads)
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mlp_config, shared_tempdir, synthetic_classification  # noqa: E402

from hpctrain.backend.cpu import CpuBackend  # noqa: E402
from hpctrain.parallel.data_parallel import GradSync  # noqa: E402
from hpctrain.parallel.mesh import Mesh  # noqa: E402
from hpctrain.parallel.transport import Transport  # noqa: E402
from hpctrain.params import FlatBuffer, ParamLayout  # noqa: E402
from hpctrain.train import Trainer  # noqa: E402


def say(*a):
    if MPI.COMM_WORLD.rank == 0:
        print(*a, flush=True)


def bench_sync(comm, megabytes, bucket_mb, repeat):
    n = int(megabytes * 1e6 / 4)
    layout = ParamLayout([("flat", (n,))])
    grads = FlatBuffer(CpuBackend(), layout)
    grads.data[:] = 1.0
    syncs = {dtype: GradSync(comm=comm, transport=Transport(CpuBackend(), cuda_aware=False), grads=grads,
                             bucket_mb=bucket_mb, overlap=True, reduce_dtype=dtype) for dtype in ("fp32", "bf16")}
    sync = syncs["fp32"]
    bare = np.ones(n, dtype=np.float32)
    t_sync, t_bare, t_chunks, t_bf16 = [], [], [], []
    for _ in range(repeat):  # interleaved, so drift in the machine's load hits both alike
        for dtype, times in (("fp32", t_sync), ("bf16", t_bf16)):
            grads.data[:] = 1.0  # the same values each time (a bf16 sum of ones stays exact)
            comm.Barrier()
            t0 = time.perf_counter()
            syncs[dtype].start_step()
            syncs[dtype].grads_final(0)
            syncs[dtype].wait()
            times.append(time.perf_counter() - t0)
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, bare, op=MPI.SUM)
        t_bare.append(time.perf_counter() - t0)
        comm.Barrier()
        t0 = time.perf_counter()
        for lo, hi in sync.buckets:
            comm.Allreduce(MPI.IN_PLACE, bare[lo:hi], op=MPI.SUM)
        t_chunks.append(time.perf_counter() - t0)
    ts, tb, tc, t16 = np.median(t_sync), np.median(t_bare), np.median(t_chunks), np.median(t_bf16)
    nbytes = n * 4
    say(f"sync {megabytes:g} MB in {len(sync.buckets)} bucket(s) of {bucket_mb:g} MB: hpctrain {nbytes / ts / 1e9:.2f} GB/s, "
        f"bare Allreduce {nbytes / tb / 1e9:.2f} GB/s, efficiency {tb / ts:.3f} (target >= 0.90); "
        f"bare Allreduce per bucket {nbytes / tc / 1e9:.2f} GB/s, efficiency against that {tc / ts:.3f}")
    say(f"the same sync in bfloat16 messages (parallel.reduce_dtype, {syncs['bf16'].sent_bytes / 1e6:.0f} MB handed "
        f"to MPI against {sync.sent_bytes / 1e6:.0f} MB): {t16 * 1e3:.1f} ms against {ts * 1e3:.1f} ms, "
        f"{t16 / ts:.2f}x the float32 sync's time")
    for s in syncs.values():
        s.close()


def bench_overlap(mesh, sizes, batch, bucket_mb, steps):
    """Two trainers, overlap off and on, stepped alternately so drift in the machine hits both alike."""
    folder = shared_tempdir(mesh.world)
    path = os.path.join(folder, "d.h5")
    if mesh.rank == 0:
        synthetic_classification(path, 8 * batch, sizes[0], sizes[-1])
    mesh.world.Barrier()
    base = mlp_config(path, sizes, batch, "sgd")
    trainers = {overlap: Trainer(dataclasses.replace(base, parallel=dataclasses.replace(
        base.parallel, bucket_mb=bucket_mb, overlap=overlap)), mesh=mesh, log=lambda *a: None)
        for overlap in (False, True)}
    total = {False: [], True: []}
    comm = {False: [], True: []}
    for s in range(steps + 3):
        for overlap, trainer in trainers.items():
            mesh.world.Barrier()
            t0 = time.perf_counter()
            timing = trainer.train_step(s, 1e-3)
            if s >= 3:  # warm-up steps are not counted
                total[overlap].append(time.perf_counter() - t0)
                comm[overlap].append(timing["comm"])
    for trainer in trainers.values():
        trainer.close()
    mesh.world.Barrier()
    if mesh.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    t_off, t_on = np.median(total[False]), np.median(total[True])
    comm_off, wait_on = np.median(comm[False]), np.median(comm[True])
    hidden = (t_off - t_on) / comm_off if comm_off > 0 else float("nan")
    say(f"overlap, MLP {'-'.join(map(str, sizes))} batch {batch}, buckets of {bucket_mb:g} MB, {steps} alternating "
        f"steps: without overlap {t_off * 1e3:.1f} ms (Allreduce {comm_off * 1e3:.1f} ms), with overlap "
        f"{t_on * 1e3:.1f} ms (wait after backward {wait_on * 1e3:.1f} ms); hidden {hidden:.2f} of the "
        f"communication (target >= 0.5)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sync-mb", type=float, default=100)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--steps", type=int, default=40, help="alternating steps of the overlap benchmark")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--overlap-bucket-mb", type=float, default=4)
    a = p.parse_args()
    mesh = Mesh()
    say(f"{MPI.Get_library_version().splitlines()[0].strip()}; {mesh.describe()}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    bench_sync(mesh.dp_comm, a.sync_mb, a.bucket_mb, a.repeat)
    bench_overlap(mesh, [1024, a.hidden, a.hidden, a.hidden, 10], a.batch, a.overlap_bucket_mb, a.steps)


if __name__ == "__main__":
    main()
