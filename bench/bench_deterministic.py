"""What ``train.deterministic`` costs: step time with and without it, at dp = 2, for the digits and gpt-char jobs.

    python bench/bench_deterministic.py                  # both jobs, 3 rounds, mpiexec -n 2
    python bench/bench_deterministic.py --jobs digits --repeat 5

Each round runs the job once per setting (``hpctrain train JOB --set train.deterministic=...`` under
``mpiexec -n 2``), alternated so drift in the machine's load hits both alike. Step time: the median over a
run's steps (``batch_size / samples_per_s`` from the metrics file, log_every = 1, the first 5 steps left out),
then the median over rounds; the ratio deterministic / plain is what docs/performance.md records. Target:
at most 1.15. The job's own settings otherwise; deterministic with ``deterministic_shards`` 4 (the default:
two micro-batches per rank at dp 2, where the plain run has one) and 2 (one, as the plain run).
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="hpctrain-bench-det-")
    try:
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
