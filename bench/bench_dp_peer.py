"""hpctrain on 2 ranks against PyTorch DDP (gloo) on 2 processes: the same MLP, steady-state samples/s.

    python bench/bench_dp_peer.py                   # MLP 784-2048-2048-10, global batch 512, SGD
    python bench/bench_dp_peer.py --steps 40 --ranks 2

Run it as a plain process: it launches hpctrain with ``mpiexec -n RANKS`` and PyTorch
with ``torch.multiprocessing`` (gloo on 127.0.0.1), one after the other in the same run,
each rank/process with cores // ranks threads. It skips the peer with a message where
torch is not installed. Target: hpctrain >= 1.0x PyTorch DDP.

Figure: hpctrain at dp 2 / PyTorch DDP (gloo), samples/s; docs/performance.md, "Data parallel" (every run behind
it: docs/performance-log.md).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [784, 2048, 2048, 10]


def hpctrain_worker(path, batch, steps, warmup):
    """Runs under mpiexec: times steady-state steps of the real training loop."""
    sys.path.insert(0, HERE)
    import numpy as np
    from common import mlp_config

    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    mesh = Mesh()
    t = Trainer(mlp_config(path, SIZES, batch, "sgd"), mesh=mesh, log=lambda *a: None)
    for s in range(warmup):
        t.train_step(s, 0.01)
    mesh.world.Barrier()
    t0 = time.perf_counter()
    for s in range(steps):
        t.train_step(warmup + s, 0.01)
    mesh.world.Barrier()
    if mesh.rank == 0:
        print(f"RESULT {steps * batch / (time.perf_counter() - t0):.1f}")
    del np


def torch_worker(rank, world, path, batch, steps, warmup, threads, port, queue):
    import h5py
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    model = DDP(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    local = batch // world
    with h5py.File(path, "r") as f:
        n = f["x"].shape[0]
        steps_per_epoch = n // batch

        def step(s):
            lo = (s % steps_per_epoch) * batch + rank * local  # same data path as hpctrain: read this rank's rows
            x = torch.from_numpy(f["x"][lo : lo + local])
            y = torch.from_numpy(f["y"][lo : lo + local])
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()

        for s in range(warmup):
            step(s)
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(steps):
            step(warmup + s)
        dist.barrier()
        if rank == 0:
            queue.put(steps * batch / (time.perf_counter() - t0))
    dist.destroy_process_group()


def run_torch(path, a, threads):
    try:
        import torch.multiprocessing as mp
    except ImportError:
        return None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    mp.start_processes(torch_worker, args=(a.ranks, path, a.batch, a.steps, a.warmup, threads, port, queue),
                       nprocs=a.ranks, start_method="spawn", join=True)
    return queue.get()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return hpctrain_worker(a.data, a.batch, a.steps, a.warmup)
    sys.path.insert(0, HERE)
    from common import synthetic_classification

    threads = max(1, (os.cpu_count() or 1) // a.ranks)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "d.h5")
        synthetic_classification(path, 8 * a.batch, SIZES[0], SIZES[-1])
        mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
        out = subprocess.run([mpiexec, "-n", str(a.ranks), sys.executable, __file__, "--worker", "--data", path,
                              "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup)],
                             env=env, capture_output=True, text=True, check=True).stdout
        ours = float(next(line.split()[1] for line in out.splitlines() if line.startswith("RESULT")))
        theirs = run_torch(path, a, threads)
    print(f"MLP {'-'.join(map(str, SIZES))}, global batch {a.batch}, SGD momentum, {a.ranks} ranks x {threads} thread(s)")
    print(f"hpctrain (mpiexec -n {a.ranks}): {ours:,.0f} samples/s")
    if theirs is None:
        print("PyTorch DDP: skipped (torch is not installed)")
        return
    import torch

    print(f"PyTorch {torch.__version__} DDP gloo ({a.ranks} processes): {theirs:,.0f} samples/s")
    print(f"ratio hpctrain / DDP: {ours / theirs:.2f} (target >= 1.0)")


if __name__ == "__main__":
    main()
