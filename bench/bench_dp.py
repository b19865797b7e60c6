"""Data-parallel gradient sync: bucketed sync efficiency and overlap with backward.

    mpiexec -n 2 python bench/bench_dp.py
    mpiexec -n 2 python bench/bench_dp.py --sync-mb 100 --bucket-mb 25

1. Sync efficiency: bytes/s of hpctrain's bucketed sync (GradSync: Iallreduce per bucket, then
   Waitall) over a flat gradient buffer of --sync-mb megabytes, against one bare
   ``MPI.Allreduce`` on the same bytes, interleaved in the same run. Target >= 0.90.
2. Overlap: step time of a model whose gradient sync is a large part of the step (a wide MLP
   at a small batch), with overlap on and off. hidden = (T_off - T_on) / T_comm, where T_comm
   is the Allreduce time of the off runs. Target: hidden >= 0.5.
"""

import argparse
import os
import sys
import tempfile
import time

import hpctrain  # noqa: F401  (first: it shares the cores between ranks before numpy starts BLAS threads)
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mlp_config, synthetic_classification  # noqa: E402

from hpctrain.backend.cpu import CpuBackend  # noqa: E402
from hpctrain.dist.data_parallel import GradSync  # noqa: E402
from hpctrain.dist.mesh import Mesh  # noqa: E402
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
    sync = GradSync(comm=comm, backend=CpuBackend(), grads=grads, layer_ranges=[(0, n)], bucket_mb=bucket_mb,
                    overlap=True, cuda_aware=False)
    bare = np.ones(n, dtype=np.float32)
    t_sync, t_bare, t_chunks = [], [], []
    for _ in range(repeat):  # interleaved, so drift in the machine's load hits both alike
        comm.Barrier()
        t0 = time.perf_counter()
        sync.start_step()
        sync.layer_done(0)
        sync.wait()
        t_sync.append(time.perf_counter() - t0)
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, bare, op=MPI.SUM)
        t_bare.append(time.perf_counter() - t0)
        comm.Barrier()
        t0 = time.perf_counter()
        for lo, hi in sync.buckets:
            comm.Allreduce(MPI.IN_PLACE, bare[lo:hi], op=MPI.SUM)
        t_chunks.append(time.perf_counter() - t0)
    ts, tb, tc = np.median(t_sync), np.median(t_bare), np.median(t_chunks)
    nbytes = n * 4
    say(f"sync {megabytes:g} MB in {len(sync.buckets)} bucket(s) of {bucket_mb:g} MB: hpctrain {nbytes / ts / 1e9:.2f} GB/s, "
        f"bare Allreduce {nbytes / tb / 1e9:.2f} GB/s, efficiency {tb / ts:.3f} (target >= 0.90); "
        f"bare Allreduce per bucket {nbytes / tc / 1e9:.2f} GB/s, efficiency against that {tc / ts:.3f}")


def step_times(mesh, cfg, steps):
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    scale = trainer.loss.grad_scale(cfg.train.batch_size, 10)
    for s in range(3):
        trainer._train_step(s, 1e-3, scale)
    total, comm = [], []
    for s in range(steps):
        mesh.world.Barrier()
        t0 = time.perf_counter()
        timing = trainer._train_step(s, 1e-3, scale)
        total.append(time.perf_counter() - t0)
        comm.append(timing["comm"])
    trainer.close()
    return float(np.median(total)), float(np.median(comm))


def bench_overlap(mesh, sizes, batch, bucket_mb, steps):
    with tempfile.TemporaryDirectory() as tmp:
        path = tmp
        names = np.zeros(256, dtype=np.uint8)
        if mesh.rank == 0:
            path = tempfile.mkdtemp()
            synthetic_classification(os.path.join(path, "d.h5"), 8 * batch, sizes[0], sizes[-1])
            names[: len(path)] = np.frombuffer(path.encode(), dtype=np.uint8)
        mesh.world.Bcast(names, root=0)
        path = os.path.join(names.tobytes().rstrip(b"\0").decode(), "d.h5")
        results = {}
        for overlap in (False, True, False, True):  # alternate, keep the second of each
            cfg = mlp_config(path, sizes, batch, "sgd")
            cfg = type(cfg)(**{**cfg.__dict__, "parallel": type(cfg.parallel)(bucket_mb=bucket_mb, overlap=overlap)})
            results[overlap] = step_times(mesh, cfg, steps)
        (t_off, comm_off), (t_on, comm_wait_on) = results[False], results[True]
        hidden = (t_off - t_on) / comm_off if comm_off > 0 else float("nan")
        say(f"overlap, MLP {'-'.join(map(str, sizes))} batch {batch}, buckets of {bucket_mb:g} MB: step without overlap "
            f"{t_off * 1e3:.1f} ms (Allreduce {comm_off * 1e3:.1f} ms), with overlap {t_on * 1e3:.1f} ms "
            f"(wait {comm_wait_on * 1e3:.1f} ms); hidden {hidden:.2f} of the communication (target >= 0.5)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sync-mb", type=float, default=100)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--overlap-bucket-mb", type=float, default=4)
    a = p.parse_args()
    mesh = Mesh()
    say(f"{MPI.Get_library_version().splitlines()[0].strip()}; {mesh.describe()}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    bench_sync(mesh.dp_comm, a.sync_mb, a.bucket_mb, a.repeat)
    bench_overlap(mesh, [1024, a.hidden, a.hidden, a.hidden, 10], a.batch, a.overlap_bucket_mb, a.repeat)


if __name__ == "__main__":
    main()
