"""hpctrain plan against measured peak RSS: every rank of the bundled configs and of the 50 M MLP.

    python bench/bench_plan.py              # bundled configs at 1-2 ranks, the 50 M MLP at dp 1/2/4 x zero 0/1/2
    python bench/bench_plan.py --quick      # the bundled configs only

For each case: ``hpctrain plan CONFIG -n N --json`` (no MPI), then the same config trained for a few steps
under ``mpiexec -n N sh -c '/usr/bin/time -f %M -o rss.$PMI_RANK hpctrain train ...'``; each rank's plan
total against its peak RSS. Target: within 15% for every rank. MB here is 10^6 bytes.

Figure: hpctrain plan / measured peak RSS, every rank; docs/performance.md, "hpctrain plan against measured peak
RSS" (every run behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_memory import write_config  # noqa: E402
from common import synthetic_classification  # noqa: E402

BIN = os.path.dirname(sys.executable)


def measure(folder, config, ranks, overrides):
    for name in os.listdir(folder):
        if name.startswith("rss."):
            os.remove(os.path.join(folder, name))
    sets = " ".join(f"--set {o}" for o in overrides)
    timed = (f'exec /usr/bin/time -f %M -o "rss.${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}" "{BIN}/hpctrain" train '
             f'"{config}" {sets}')
    proc = subprocess.run([shutil.which("mpiexec"), "-n", str(ranks), "sh", "-c", timed], cwd=folder,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"{config} on {ranks} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    out = []
    for r in range(ranks):
        with open(os.path.join(folder, f"rss.{r}")) as f:
            out.append(int(f.read().split()[-1]) * 1024)
    return out


def planned(config, ranks, overrides):
    args = [f"{BIN}/hpctrain", "plan", config, "-n", str(ranks), "--json"] + [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(proc.stderr)
    return [m["total_bytes"] for m in json.loads(proc.stdout)["ranks"]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="hpctrain-bench-plan-")
    out = lambda name: [f"checkpoint.dir={folder}/ck-{name}", "checkpoint.resume=never",  # noqa: E731
                        f"train.metrics={folder}/m-{name}.jsonl", "train.trace="]
    cases = [("digits", f"{ROOT}/jobs/configs/digits.toml", 1, ["train.steps=30"]),
             ("digits", f"{ROOT}/jobs/configs/digits.toml", 2, ["train.steps=30"]),
             ("digits-pp2", f"{ROOT}/jobs/configs/digits-pp2.toml", 2, ["train.steps=30"]),
             ("gpt-char", f"{ROOT}/jobs/configs/gpt-char.toml", 1, ["train.steps=5", "train.eval_every=0"]),
             ("gpt-char", f"{ROOT}/jobs/configs/gpt-char.toml", 2, ["train.steps=5", "train.eval_every=0"])]
    try:
        if not args.quick:
            synthetic_classification(os.path.join(folder, "d.h5"), 128, 4096, 4096)
            for zero in (0, 1, 2):
                config = write_config(folder, 4096, 32, 3, zero, 25.0)
                for ranks in (1, 2, 4):
                    cases.append((f"MLP 50M zero {zero}", config, ranks, []))
        worst = 0.0
        print(f"{'case':<22} {'ranks':>5}  planned / measured peak RSS per rank, MB (ratio)")
        for i, (name, config, ranks, overrides) in enumerate(cases):
            sets = overrides + out(str(i))
            plan = planned(config, ranks, sets)
            rss = measure(folder, config, ranks, sets)
            ratios = [p / m for p, m in zip(plan, rss)]
            worst = max(worst, *(abs(r - 1) for r in ratios))
            print(f"{name:<22} {ranks:>5}  " + ", ".join(f"{p / 1e6:,.0f}/{m / 1e6:,.0f} ({r:.2f})"
                                                       for p, m, r in zip(plan, rss, ratios)))
        print(f"largest deviation {worst:.0%} (target <= 15%)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
