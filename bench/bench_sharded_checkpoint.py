"""Sharded checkpoints on N ranks: parallel write bandwidth, each rank's memory while saving, resharding loads.

    mpiexec -n 4 python bench/bench_sharded_checkpoint.py              # pp 4: one 4096x4096 layer per stage, Adam
    mpiexec -n 2 python bench/bench_sharded_checkpoint.py --width 2048 --layers 2
    python bench/bench_sharded_checkpoint.py --async-cost               # gpt-char: a checkpoint every 10 steps

Write: ``Trainer.save_checkpoint()`` (every rank writes its shard, hashing 1 MiB blocks; rank 0 commits
the index) against every rank writing the same bytes with ``numpy.tofile`` + ``fsync`` at the same
time, alternating, median of ``--repeat``; each includes the Barrier that ends it. Target: >= 0.8.
Memory: each rank's peak RSS growth (``ru_maxrss``) across the sharded saves, then across one
gather of the whole state to rank 0 (``Trainer.state_dict()``, what the single-file writer needed).
Load: the checkpoint written by pp = N read back (``train/checkpointing.resume``, verifying every
block read) by the same layout, by dp = N with zero = 1 (every rank holds all the parameters and
1/N of the optimizer state) and by tp = N (each weight split by rows or by columns), alternating.
The layouts hold different amounts per rank, so the target compares time per MB a rank holds:
a different layout <= 1.2x the same layout.
Async cost (one process): wall time of gpt-char's steps with a checkpoint every 10 steps written in
the background, written synchronously, and with no checkpoint. Target: background <= 1.05x none.
MB = 10^6 bytes.

Figure: sharded write / tofile + fsync, rank 0's memory while saving, resharding loads; docs/performance.md,
"Checkpoints" (every run behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hpctrain  # noqa: E402,F401 - first: it sizes the BLAS threads to this rank's share of the cores
from common import mlp_config, shared_tempdir, synthetic_classification  # noqa: E402
import numpy as np  # noqa: E402


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # Linux: KiB


def trainer(cfg, folder, **parallel):
    from hpctrain.train import Trainer

    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel),
                              checkpoint=dataclasses.replace(cfg.checkpoint, dir=folder, keep=1000))
    return Trainer(cfg, log=lambda *a: None)


def write_raw(path: str, arrays) -> None:
    with open(path, "wb") as f:
        for a in arrays:
            a.tofile(f)
        f.flush()
        os.fsync(f.fileno())


def bench_layouts(args, comm):
    from mpi4py import MPI

    from hpctrain.train.checkpointing import resume

    n = comm.size
    base = shared_tempdir(comm)
    data = os.path.join(base, "d.h5")
    if comm.rank == 0:
        synthetic_classification(data, 64, args.width, 10)
    comm.Barrier()
    sizes = [args.width] * (args.layers + 1)
    cfg = mlp_config(data, sizes, 8, optim="adam", steps=1)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    try:
        a = trainer(cfg, os.path.join(base, "a"), pp=n, dp=1)
        a.run()  # one step: the Adam slots hold values
        mine = a.saver.nbytes
        total = np.zeros(1)
        comm.Allreduce(np.array([mine], dtype=np.float64), total)
        say(f"command: python {' '.join(sys.argv)}, on {n} ranks")
        say(f"{n} ranks, pp {n}: {args.layers} x Linear({args.width}, {args.width}) with Adam; "
            f"{total[0] / 1e6:,.0f} MB per checkpoint, {mine / 1e6:,.0f} MB from rank 0")
        before = peak_mb()
        raw_dir = os.path.join(base, "raw")
        os.makedirs(raw_dir, exist_ok=True)
        host = [a.params.data] + [b.data for b in a.optim.slots.values()]
        sharded, raw = [], []
        for r in range(args.repeat):
            comm.Barrier()
            t0 = time.perf_counter()
            a.save_checkpoint()
            comm.Barrier()
            sharded.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            write_raw(os.path.join(raw_dir, f"rank{comm.rank}-{r}.bin"), host)
            comm.Barrier()
            raw.append(time.perf_counter() - t0)
            if comm.rank == 0:  # both writers' files go outside the clock (retention is not writing)
                shutil.rmtree(raw_dir)
                os.makedirs(raw_dir)
                for name in os.listdir(a.cfg.checkpoint.dir):
                    if name.startswith("ckpt-") and r < args.repeat - 1:
                        path = os.path.join(a.cfg.checkpoint.dir, name)
                        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            comm.Barrier()
        s, w = statistics.median(sharded), statistics.median(raw)
        say(f"write: sharded save {s:.3f} s = {total[0] / s / 1e6:,.0f} MB/s; numpy.tofile + fsync {w:.3f} s = "
            f"{total[0] / w / 1e6:,.0f} MB/s; ratio {w / s:.2f} (target >= 0.8)")
        grow = np.zeros(n)
        comm.Allgather(np.array([peak_mb() - before]), grow)
        before = peak_mb()
        a.state_dict()  # the old way: every buffer gathered to rank 0
        gathered = np.zeros(n)
        comm.Allgather(np.array([peak_mb() - before]), gathered)
        say("peak RSS growth while saving, MB by rank: sharded " + ", ".join(f"{g:.0f}" for g in grow)
            + "; gathering to rank 0 (single file) " + ", ".join(f"{g:.0f}" for g in gathered))
        index = a.saver.last_path if comm.rank == 0 else ""
        others = [("dp", dict(pp=1, dp=n, zero=1 if n > 1 else 0))] + \
            ([("tp", dict(pp=1, dp=1, tp=n))] if n > 1 and args.width % n == 0 else [])
        readers = [("same", a)] + [(name, trainer(cfg, os.path.join(base, name), **lay)) for name, lay in others]
        times = {name: [] for name, _ in readers}
        for _ in range(args.repeat):
            for name, t in readers:
                comm.Barrier()
                t0 = time.perf_counter()
                resume(t, [index] if comm.rank == 0 else [], auto=False)
                comm.Barrier()
                times[name].append(time.perf_counter() - t0)
        held = {}
        for name, t in readers:  # MB each rank loads: its parameters and its optimizer pieces, largest rank
            mine = np.array([4.0 * (t.part.owned_size + sum(b.layout.size for b in t.optim.slots.values()))])
            most = np.zeros(1)
            comm.Allreduce(mine, most, op=MPI.MAX)
            held[name] = most[0] / 1e6
        base_rate = statistics.median(times["same"]) / held["same"]
        for name, t in readers:
            m = statistics.median(times[name])
            say(f"load {name:>4} ({t.mesh.describe()}, zero {t.zero}): {m:.3f} s for {held[name]:,.0f} MB on the "
                f"largest rank = {held[name] / m:,.0f} MB/s per rank; time per MB vs same layout "
                f"{m / held[name] / base_rate:.2f} (target <= 1.2)")
        for name, t in readers[1:]:
            t.close()
        a.close()
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(base, ignore_errors=True)


def bench_async(args):
    import tempfile

    from hpctrain.config import load_config
    from hpctrain.train import Trainer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = tempfile.mkdtemp(prefix="hpctrain-bench-")
    print(f"command: python {' '.join(sys.argv)}")
    times = {"none": [], "background": [], "synchronous": []}
    try:
        for r in range(args.repeat):
            for kind in times:
                folder = os.path.join(base, f"{kind}-{r}")
                over = [f"train.steps={args.steps}", "train.eval_every=0", "train.log_every=1000000",
                        f"checkpoint.dir={folder if kind != 'none' else ''}", "checkpoint.every=10",
                        f"checkpoint.async={'true' if kind == 'background' else 'false'}"]
                cfg = load_config(os.path.join(root, "jobs", "configs", "gpt-char.toml"), over)
                t = Trainer(cfg, log=lambda *a: None)
                t0 = time.perf_counter()
                t.run()
                times[kind].append(time.perf_counter() - t0)
                t.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        per = {k: v / args.steps * 1e3 for k, v in med.items()}
        print(f"gpt-char, {args.steps} steps, a checkpoint every 10: " + "; ".join(
            f"{k} {per[k]:.1f} ms/step" for k in times)
              + f"; background / none {med['background'] / med['none']:.3f} (target <= 1.05), "
                f"synchronous / none {med['synchronous'] / med['none']:.3f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4, help="Linear layers (one stage each at pp = ranks)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--async-cost", action="store_true", help="gpt-char with checkpoints in the background (1 rank)")
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    if args.async_cost:
        bench_async(args)
        return
    from mpi4py import MPI

    bench_layouts(args, MPI.COMM_WORLD)


if __name__ == "__main__":
    main()
