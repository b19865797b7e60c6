"""What ``train.deterministic`` costs: step time with and without it, at dp = 2, for the digits and gpt-char jobs.

    python bench/bench_deterministic.py                  # both jobs, 3 rounds, mpiexec -n 2
    python bench/bench_deterministic.py --jobs digits --repeat 5
    python bench/bench_deterministic.py --blocks 100      # inside one job, blocks of steps alternated
    python bench/bench_deterministic.py --blocks 100 --jobs digits --probe-fused

Each round runs the job once per setting (``hpctrain train JOB --set train.deterministic=...`` under
``mpiexec -n 2``), alternated so drift in the machine's load hits both alike. Step time: the median over a
run's steps (``batch_size / samples_per_s`` from the metrics file, log_every = 1, the first 5 steps left out),
then the median over rounds; the ratio deterministic / plain is what docs/performance.md records. Target:
at most 1.15. The job's own settings otherwise; deterministic with ``deterministic_shards`` 4 (the default:
two micro-batches per rank at dp 2, where the plain run has one) and 2 (one, as the plain run).

``--blocks N`` measures the same three settings inside one ``mpiexec -n 2`` job instead: each rank builds the
three ``Trainer``s and runs blocks of ``--block-steps`` training steps of each in turn (a Barrier around each
block), ``N`` blocks after two untimed ones; it prints the median of the per-block ratios against the plain
block beside it. Steps only (``Trainer.train_step``: no log lines, no loss reductions); far less noisy than
separate runs on a shared machine, since each ratio compares blocks a few milliseconds apart.

Figure: step time with train.deterministic / plain, digits and gpt-char at dp 2; docs/performance.md,
"Deterministic mode" (every run behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = {"digits": ("jobs/configs/digits.toml", 300), "gpt-char": ("jobs/configs/gpt-char.toml", 40)}


def run_once(folder, job, steps, shards: int) -> float:
    """Median step time of one run; ``shards`` 0: plain, else deterministic with that many shards."""
    deterministic = bool(shards)
    config, _ = JOBS[job]
    bin_dir = os.path.dirname(sys.executable)
    metrics = os.path.join(folder, f"{job}-{shards}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    sets = {"train.deterministic": "true" if deterministic else "false", "train.steps": steps,
            "train.deterministic_shards": shards or 4,
            "train.log_every": 1, "train.eval_every": 0, "train.metrics": f'"{metrics}"',
            "checkpoint.dir": f'"{folder}/ck-{job}-{shards}"', "checkpoint.every": 0}
    if job == "gpt-char":
        sets["data.path"] = f'"{folder}/pydoc-chars.h5"'
    shutil.rmtree(f"{folder}/ck-{job}-{shards}", ignore_errors=True)
    cmd = [os.path.join(bin_dir, "mpiexec"), "-n", "2", os.path.join(bin_dir, "hpctrain"), "train",
           os.path.join(ROOT, config)] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(metrics) as f:
        rows = [r for r in map(json.loads, f) if "samples_per_s" in r]
    batch = 64 if job == "digits" else 32
    return statistics.median(batch / r["samples_per_s"] for r in rows[5:])


def fused_linear(k: int):
    """The what-if of ``--probe-fused``: Linear's forward and backward for a micro-batch of ``k`` equal shards,
    each product over one shard's rows (the shapes a one-shard micro-batch has, so the same bits) and the shards'
    weight and bias gradients summed as the shard tree would (k = 2); activations and the loss see the whole
    micro-batch. Not hpctrain's code path: it measures what running a rank's shards as one micro-batch could save."""
    assert k == 2

    def forward(self, be, x):
        out, r = be.empty((x.shape[0], self.out_features)), x.shape[0] // k
        for s in range(k):
            be.matmul_nt(x[s * r:(s + 1) * r], self.w["weight"], out[s * r:(s + 1) * r], bias=self.w.get("bias"))
        return out, x

    def backward(self, be, dout, x, accumulate=False, need_dinp=True):
        r, g, b = x.shape[0] // k, self.g["weight"], self.g["bias"]
        be.matmul_tn(dout[:r], x[:r], g)
        be.bias_grad(dout[:r], b)
        g1, b1 = be.empty(g.shape), be.empty(b.shape)
        be.matmul_tn(dout[r:], x[r:], g1)
        be.bias_grad(dout[r:], b1)
        be.add_(g, g1)
        be.add_(b, b1)
        if not need_dinp:
            return None
        dinp = be.empty(x.shape)
        for s in range(k):
            be.matmul_nn(dout[s * r:(s + 1) * r], self.w["weight"], dinp[s * r:(s + 1) * r])
        return dinp

    return forward, backward


def gemm_microseconds(rows: int, widths=(64, 128, 128, 10), repeat: int = 2000) -> float:
    """µs of one micro-batch's Linear products on ``rows`` rows through ``widths`` (the digits model): each layer's
    forward x·Wᵀ and weight gradient dYᵀ·x, and the input gradient dY·W of every layer but the first, timed
    with numpy as the CPU backend calls them (median of 5 rounds of ``repeat``)."""
    import time

    import numpy as np

    rng = np.random.default_rng(0)
    calls = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        x, w = rng.random((rows, n_in), np.float32), rng.random((n_out, n_in), np.float32)
        dy, y, g, dx = rng.random((rows, n_out), np.float32), np.empty((rows, n_out), np.float32), \
            np.empty((n_out, n_in), np.float32), np.empty((rows, n_in), np.float32)
        calls += [lambda x=x, w=w, y=y: np.matmul(x, w.T, out=y), lambda dy=dy, x=x, g=g: np.matmul(dy.T, x, out=g)]
        if i:
            calls.append(lambda dy=dy, w=w, dx=dx: np.matmul(dy, w, out=dx))
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            for call in calls:
                call()
        rounds.append((time.perf_counter() - t0) / repeat * 1e6)
    return statistics.median(rounds)


def blocks_worker(job: str, folder: str, blocks: int, per: int, probe_fused: bool = False) -> None:
    """Under ``mpiexec -n 2``: the three settings' Trainers in this process, their steps run block by block
    (``probe_fused``: a fourth, ``fused_linear``'s what-if on the 2-shard Trainer's one micro-batch)."""
    import time

    from mpi4py import MPI

    from hpctrain import Trainer, load_config
    from hpctrain.nn.layers import Linear

    world = MPI.COMM_WORLD
    config, _ = JOBS[job]
    trainers = {}
    settings = (0, 4, 2) + (("fused",) if probe_fused else ())
    plain_linear, probe = (Linear.forward, Linear.backward), fused_linear(2)
    for shards in settings:
        n = 2 if shards == "fused" else shards
        sets = [f"train.deterministic={'true' if n else 'false'}", f"train.deterministic_shards={n or 4}",
                "train.steps=1000000", "train.log_every=1000000", "train.eval_every=0", 'train.metrics=""',
                f'checkpoint.dir="{folder}/ck-{job}-{shards}"', "checkpoint.every=0"]
        if job == "gpt-char":
            sets.append(f'data.path="{folder}/pydoc-chars.h5"')
        trainers[shards] = Trainer(load_config(os.path.join(ROOT, config), sets), log=lambda *a: None)
    times = {shards: [] for shards in trainers}
    parts = {shards: {k: [] for k in ("compute", "data", "comm", "optim")} for shards in trainers}
    step = 0
    for b in range(blocks + 2):
        for shards, trainer in trainers.items():
            Linear.forward, Linear.backward = probe if shards == "fused" else plain_linear
            world.Barrier()
            t0 = time.perf_counter()
            for i in range(per):
                timing = trainer.train_step(step + i, 1e-3)
                if b >= 2:
                    for k, v in parts[shards].items():
                        v.append(timing[k])
            world.Barrier()
            if b >= 2:
                times[shards].append((time.perf_counter() - t0) / per)
        step += per
    for trainer in trainers.values():
        trainer.close()
    if world.rank == 0:
        plain = statistics.median(times[0])
        ratios = {s: statistics.median(t / p for t, p in zip(times[s], times[0])) for s in settings[1:]}
        print(f"{job}: dp 2, step {plain * 1e3:.2f} ms plain; deterministic "
              + ", ".join(f"{s if s == 'fused' else f'{s} shards'} {statistics.median(times[s]) * 1e3:.2f} ms, "
                          f"{ratios[s]:.3f}x" for s in settings[1:])
              + f" (median of {blocks} per-block ratios; blocks of {per} steps)", flush=True)
        for shards in settings:  # rank 0's share, the medians over steps (the executor's and optimizer's clocks)
            name = "plain" if shards == 0 else shards if shards == "fused" else f"{shards} shards"
            print(f"    {name}: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in parts[shards].items())
                  + " ms a step (rank 0)", flush=True)
    if probe_fused and job == "digits":  # the floor of a second micro-batch: the same products on half the rows
        world.Barrier()
        times = [gemm_microseconds(16), gemm_microseconds(32)]
        if world.rank == 0:
            print(f"    the digits model's 8 products of one micro-batch: {times[0]:.1f} µs on 16 rows, "
                  f"{times[1]:.1f} µs on 32 (both ranks timing at once)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=0, help="alternate blocks of steps inside one job (see above)")
    ap.add_argument("--block-steps", type=int, default=0, help="steps per block (default: 20 digits, 3 gpt-char)")
    ap.add_argument("--probe-fused", action="store_true",
                    help="with --blocks: also the what-if of a rank's two shards as one micro-batch (fused_linear)")
    ap.add_argument("--worker", nargs=2, metavar=("JOB", "FOLDER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        job, folder = args.worker
        blocks_worker(job, folder, args.blocks, args.block_steps, args.probe_fused)
        return 0
    folder = tempfile.mkdtemp(prefix="hpctrain-bench-det-")
    try:
        if args.blocks:
            bin_dir = os.path.dirname(sys.executable)
            for job in args.jobs:
                per = args.block_steps or (20 if job == "digits" else 3)
                cmd = [os.path.join(bin_dir, "mpiexec"), "-n", "2", sys.executable, os.path.abspath(__file__),
                       "--worker", job, folder, "--blocks", str(args.blocks), "--block-steps", str(per)] + \
                    (["--probe-fused"] if args.probe_fused else [])
                proc = subprocess.run(cmd, cwd=folder, text=True)
                if proc.returncode:
                    sys.exit(f"{' '.join(cmd)} failed ({proc.returncode})")
            return 0
        for job in args.jobs:
            steps = JOBS[job][1]
            times = {0: [], 4: [], 2: []}
            for _ in range(args.repeat):
                for shards in times:
                    times[shards].append(run_once(folder, job, steps, shards))
            plain = statistics.median(times[0])
            rounds = "; ".join(f"{'plain' if s == 0 else f'{s} shards'} " + ", ".join(f"{t * 1e3:.2f}" for t in ts)
                               for s, ts in times.items())
            print(f"{job}: dp 2, step {plain * 1e3:.2f} ms plain; deterministic "
                  + ", ".join(f"{s} shards {statistics.median(times[s]) * 1e3:.2f} ms = "
                              f"{statistics.median(times[s]) / plain:.2f}x" for s in (4, 2))
                  + f" (rounds: {rounds} ms)", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
