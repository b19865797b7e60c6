"""ZeRO's memory and speed: every rank's peak RSS and the step time at parallel.zero = 0, 1 and 2.

    python bench/bench_memory.py                        # the 50 M-parameter MLP: RSS at dp 4, step time at dp 2
    python bench/bench_memory.py --width 1024 --steps 3 # a quick look
    python bench/bench_memory.py --zeros 2,3            # zero 3 against zero 2 (issue 51)
    python bench/bench_memory.py --only speed --repeat 7 --speed-steps 16   # with Open MPI's mpiexec first on
                                      # PATH (as root: OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)

The model is an MLP of three ``--width`` x ``--width`` Linear layers (4096: 50.3 M parameters) trained
with Adam, so a rank holds 4 bytes per parameter of weights, 4 of gradients and 8 of optimizer state.
Against zero = 0, zero = 1 saves 8N(1 - 1/dp) bytes of optimizer state (6N at dp 4) and zero = 2 another
4N(1 - 1/dp) of gradients (9N in all at dp 4). Targets: each rank's peak RSS falls by at least 75% of
that; step time with zero 1 and 2 at least 0.95x zero = 0 at dp 2.

1. Memory: ``mpiexec -n 4 sh -c '/usr/bin/time -f %M -o rss.$PMI_RANK hpctrain train ...'`` once per zero
   setting: each rank's peak RSS (kB); the log line gives what hpctrain says each rank holds.
2. Speed: ``mpiexec -n 2 hpctrain train ...`` per zero setting, alternated over ``--repeat`` rounds so
   drift in the machine's load hits each alike; the median of the mean step time (compute + comm +
   optim, from the metrics file, the first step left out), and how ZeRO summed its buckets in each run
   (``parallel.zero_reduce = "auto"``'s choice, from the log).
MB here is 10^6 bytes.

Figure: each rank's peak RSS and the step time at zero 0, 1 and 2; docs/performance.md, "ZeRO: memory and speed"
(every run behind it: docs/performance-log.md).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import synthetic_classification  # noqa: E402


SHARDED = {0: 0, 1: 8, 2: 12, 3: 16}  # bytes per parameter each zero stage shards over dp (Adam)


def write_config(folder, width, batch, steps, zero, bucket_mb, depth=3):
    layers = ", ".join(f'{{type = "linear", in = {width}, out = {width}}}' + (', {type = "relu"}' if i < depth - 1
                                                                            else "") for i in range(depth))
    path = os.path.join(folder, f"zero{zero}.toml")
    with open(path, "w") as f:
        f.write(f"""[model]
layers = [{layers}]
[data]
path = "d.h5"
inputs = "x"
targets = "y"
val_fraction = 0.0
shuffle = false
[train]
batch_size = {batch}
steps = {steps}
log_every = 1
eval_every = 0
backend = "cpu"
metrics = "m{zero}.jsonl"
[optim]
name = "adam"
lr = 1e-4
[parallel]
zero = {zero}
bucket_mb = {bucket_mb}
""")
    return path


def mpiexec():
    found = shutil.which("mpiexec")
    if found is None:
        sys.exit("mpiexec not found: pip install 'hpctrain[mpich]'")
    return found


def run(cmd, folder):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDI_"))}
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def peak_rss(folder, config, ranks):
    """Every rank's peak RSS in MB, from /usr/bin/time -f %M (kB), each rank's into its own file."""
    hpctrain = os.path.join(os.path.dirname(sys.executable), "hpctrain")
    for name in os.listdir(folder):
        if name.startswith("rss."):
            os.remove(os.path.join(folder, name))
    timed = f'exec /usr/bin/time -f %M -o "rss.${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}" "{hpctrain}" train "{config}"'
    proc = run([mpiexec(), "-n", str(ranks), "sh", "-c", timed], folder)
    peaks = []
    for rank in range(ranks):
        with open(os.path.join(folder, f"rss.{rank}")) as f:
            peaks.append(int(f.read().split()[-1]) * 1024 / 1e6)
    said = [line for line in proc.stdout.splitlines() if line.startswith("zero ")]
    return sorted(peaks), said


def step_seconds(folder, config, zero, ranks):
    hpctrain = os.path.join(os.path.dirname(sys.executable), "hpctrain")
    metrics = os.path.join(folder, f"m{zero}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    proc = run([mpiexec(), "-n", str(ranks), hpctrain, "train", config], folder)
    with open(metrics) as f:
        lines = [json.loads(line) for line in f if '"loss"' in line]
    rows = lines[1:]  # the first: compiles and faults
    parts = {k: statistics.mean(r[f"{k}_s"] for r in rows) for k in ("compute", "comm", "optim")}
    how = [line.split("buckets summed by ")[1].split()[0] for line in proc.stdout.splitlines()
           if "buckets summed by " in line]  # parallel.zero_reduce's choice, from the log
    return sum(parts.values()), parts, how[0] if how else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--memory-ranks", type=int, default=4)
    ap.add_argument("--speed-ranks", type=int, default=2)
    ap.add_argument("--speed-steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--only", choices=("memory", "speed"), help="run one half of the benchmark")
    ap.add_argument("--zeros", default="0,1,2", help="the parallel.zero settings, the first the baseline (0,1,2,3)")
    ap.add_argument("--layers", type=int, default=3, help="Linear layers (each a unit zero 3 gathers whole)")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="hpctrain-bench-memory-")
    try:
        synthetic_classification(os.path.join(folder, "d.h5"), 4 * args.batch, args.width, args.width)
        zeros = [int(z) for z in args.zeros.split(",")]
        n = args.layers * (args.width * args.width + args.width)
        dp = args.memory_ranks
        print(f"MLP {args.layers} x {args.width}^2: N = {n / 1e6:.1f} M parameters, Adam; peak RSS per rank at dp {dp} "
              f"({args.steps} steps, batch {args.batch}, buckets {args.bucket_mb:g} MB)")
        base = None
        for zero in zeros if args.only != "speed" else ():
            config = write_config(folder, args.width, args.batch, args.steps, zero, args.bucket_mb, args.layers)
            peaks, said = peak_rss(folder, config, dp)
            worst = max(peaks)
            line = f"  zero {zero}: peak RSS per rank {', '.join(f'{p:,.0f}' for p in peaks)} MB (max {worst:,.0f})"
            if base is None:
                base = worst
            else:
                theory = (SHARDED[zero] - SHARDED[zeros[0]]) * n * (1 - 1 / dp) / 1e6
                saved = base - worst
                line += (f"; saved {saved:,.0f} MB of the theoretical {theory:,.0f} ({saved / theory:.0%}; "
                         "target >= 75%)")
            print(line)
            for s in said[:1]:
                print(f"    rank 0 says: {s}")
        if args.only == "memory":
            return
        print(f"step time at dp {args.speed_ranks} ({args.speed_steps} steps, median of {args.repeat} rounds):")
        times, split, ways = ({z: [] for z in zeros} for _ in range(3))
        for _ in range(args.repeat):
            for zero in zeros:
                config = write_config(folder, args.width, args.batch, args.speed_steps, zero, args.bucket_mb,
                                      args.layers)
                total, parts, how = step_seconds(folder, config, zero, args.speed_ranks)
                times[zero].append(total)
                split[zero].append(parts)
                ways[zero].append(how)
        t0 = statistics.median(times[zeros[0]])
        for zero in zeros:
            t = statistics.median(times[zero])
            parts = ", ".join(f"{k} {statistics.median(p[k] for p in split[zero]) * 1e3:.0f}"
                              for k in ("compute", "comm", "optim"))
            summed = ", ".join(f"{w} in {ways[zero].count(w)}" for w in sorted(set(ways[zero]) - {None}))
            print(f"  zero {zero}: {t * 1e3:,.1f} ms/step ({parts} ms)"
                  + (f"; speed {t0 / t:.3f}x zero {zeros[0]}; buckets summed by {summed} of "
                     f"{args.repeat} rounds" if zero != zeros[0] else ""))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
