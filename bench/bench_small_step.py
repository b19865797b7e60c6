"""A small model's step in one process, where per-call overhead (argument checks, dispatch) is most of it.

    python bench/bench_small_step.py                  # this checkout, 3 rounds
    python bench/bench_small_step.py --before 76d32ea # against git revision 76d32ea, alternated

The digits job's model (64-128-128-10, AdamW) at batch 32, one process: ``Trainer.train_step`` timed over
``--steps`` steps after 50 untimed, for the plain step and for ``train.deterministic`` with 2 shards (two
micro-batches of 16: what one rank of the deterministic dp 2 digits run does with the default 4 shards).
Each measurement is a fresh process; with ``--before REV`` the revision is extracted with ``git archive``
and run the same way, one process of each alternated. Median of ``--rounds`` per tree and setting.

Figure: a small model's step time, plain and deterministic, against another revision; docs/performance.md,
"Deterministic mode" (every run behind it: docs/performance-log.md).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from common import extract_revision  # noqa: E402

WORKER = r"""
import sys, time
from hpctrain import Trainer, load_config
shards, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
sets = ["train.steps=100000", "train.eval_every=0", "train.log_every=100000", f"checkpoint.dir={out}",
        "checkpoint.every=0", "train.batch_size=32", 'train.metrics=""', "train.backend=cpu"]
if shards:
    sets += ["train.deterministic=true", f"train.deterministic_shards={shards}"]
t = Trainer(load_config("jobs/configs/digits.toml", sets), log=lambda *a: None)
for i in range(50):
    t.train_step(i, 0.001)
t0 = time.perf_counter()
for i in range(50, 50 + steps):
    t.train_step(i, 0.001)
print((time.perf_counter() - t0) / steps * 1e3)
t.close()
"""


def one_run(tree: str, shards: int, steps: int, out_dir: str) -> float:
    """ms per step of one fresh process run from ``tree``."""
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, "-c", WORKER, str(shards), str(steps), out_dir], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the step worker (in {tree}) failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return float(done.stdout.split()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--before", metavar="REV", help="also time git revision REV, alternated with this checkout")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-small-step-") as d:
        trees = [("now", ROOT)]
        if a.before:
            trees.insert(0, (f"before ({a.before})", extract_revision(a.before, os.path.join(d, "before"))))
        settings = [("plain", 0), ("deterministic, 2 shards", 2)]
        times = {(label, name): [] for label, _ in trees for name, _ in settings}
        for _ in range(a.rounds):
            for label, tree in trees:
                for name, shards in settings:
                    times[label, name].append(one_run(tree, shards, a.steps, os.path.join(d, "runs")))
        for (label, name), runs in times.items():
            print(f"{label}, {name}: {statistics.median(runs):.3f} ms/step (runs {', '.join(f'{x:.3f}' for x in runs)})")
        if a.before:
            for name, _ in settings:
                now, before = (statistics.median(times[label, name]) for label, _ in (trees[-1], trees[0]))
                print(f"{name}: now / before {now / before:.3f}")


if __name__ == "__main__":
    main()
