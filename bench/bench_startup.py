"""A whole command's start-up: ``hpctrain train`` of a one-step digits run, timed from the shell's point of view.

    python bench/bench_startup.py                    # this checkout, 5 runs
    python bench/bench_startup.py --before f202781   # against git revision f202781, runs alternated
    python bench/bench_startup.py --runs 9 --backend cpu

Each run is ``python -m hpctrain train jobs/configs/digits.toml`` with one step, no evaluation and no checkpoint,
started as a fresh process (interpreter, imports, backend choice, the data scan, the model, one step, exit): what
a user waits for before the first log line, plus one tiny step. ``--before REV`` extracts REV with ``git archive``
into a temporary folder and times it the same way, one run of each alternated, so both see the same machine.
Its first run of each tree is left out (numba compiles or loads its kernel cache then). The medians and every
run are printed. ``--backend`` sets ``train.backend`` (the bundled config's ``auto`` by default: on a machine
without a GPU, what "auto" costs is part of the figure).

Figure: a one-step `hpctrain train`'s wall time from the shell, against another revision; docs/performance.md,
"Start-up" (every run behind it: docs/performance-log.md).
"""

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from common import extract_revision  # noqa: E402


def one_run(tree: str, backend: str, out_dir: str) -> float:
    """Seconds for one fresh ``hpctrain train`` process run from ``tree``."""
    cmd = [sys.executable, "-m", "hpctrain", "train", "jobs/configs/digits.toml", "--set", "train.steps=1",
           "--set", "train.eval_every=0", "--set", "checkpoint.every=0", "--set", f"checkpoint.dir={out_dir}",
           "--set", f"train.backend={backend}"]
    env = dict(os.environ, PYTHONPATH=tree)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{shlex.join(cmd)} (in {tree}) failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return took


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="timed runs of each tree (after one untimed)")
    p.add_argument("--before", metavar="REV", help="also time git revision REV, alternated with this checkout")
    p.add_argument("--backend", default="auto", help="train.backend for every run (default: auto)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-startup-") as d:
        trees = [("now", ROOT)]
        if a.before:
            trees.insert(0, (f"before ({a.before})", extract_revision(a.before, os.path.join(d, "before"))))
        times = {label: [] for label, _ in trees}
        for label, tree in trees:  # untimed: numba's kernel cache of each tree is written or read once
            one_run(tree, a.backend, os.path.join(d, "runs"))
        for _ in range(a.runs):
            for label, tree in trees:
                times[label].append(one_run(tree, a.backend, os.path.join(d, "runs")))
        for label, runs in times.items():
            print(f"{label}: {' '.join(f'{x:.2f}' for x in sorted(runs))} s (median {statistics.median(runs):.2f})")
        if a.before:
            now, before = (statistics.median(times[label]) for label, _ in (trees[-1], trees[0]))
            print(f"now / before: {now / before:.2f}")


if __name__ == "__main__":
    main()
