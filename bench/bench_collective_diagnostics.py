"""What collective diagnostics cost: the digits job with them off, with the watchdog, with fingerprints, alternating.

    python bench/bench_collective_diagnostics.py                # 2 ranks, 3 launches of each, 400 steps
    python bench/bench_collective_diagnostics.py --ranks 2 --repeats 5 --steps 1000

Run it plainly (not under mpiexec): it starts ``mpiexec -n RANKS`` itself, re-invoking this file with
--worker, one BLAS thread per rank. Each launch trains jobs/configs/digits.toml (CPU backend, no
checkpoints or metrics, no evaluation but the final one) and times ``Trainer.run()`` between Barriers:

  off          train.debug_collectives = false, train.collective_timeout = 0 (the default: the
               communicators are mpi4py's own, nothing of parallel/watch.py is created)
  watchdog     train.collective_timeout = 60 (the proxy records each call; a thread per rank sends
               heartbeats to rank 0 every second)
  fingerprints train.debug_collectives = true (an Allgather of a 240-byte record before every
               collective, and one message before every point-to-point one)

The configurations alternate, the order rotating each repeat; figures are medians of the wall time
per step, and ratios against "off" from the same run. Target (issue 14): off costs nothing
measurable; the others are priced, not targeted.

Figure: step time with the watchdog and with fingerprints against none; docs/performance.md, "Collective
diagnostics" (every run behind it: docs/performance-log.md).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "jobs", "configs", "digits.toml")
SETTINGS = {"off": [], "watchdog": ["train.collective_timeout=60"], "fingerprints": ["train.debug_collectives=true"]}


def worker(a):
    from mpi4py import MPI

    from hpctrain.config import load_config
    from hpctrain.train import Trainer

    cfg = load_config(CONFIG, ['train.backend="cpu"', 'train.metrics=""', 'checkpoint.dir=""', "train.eval_every=0",
                               f"train.steps={a.steps}", f"train.log_every={a.steps}"] + SETTINGS[a.worker])
    trainer = Trainer(cfg, log=lambda *args, **kwargs: None)
    world = MPI.COMM_WORLD
    world.Barrier()
    t0 = time.perf_counter()
    trainer.run()
    world.Barrier()
    wall = time.perf_counter() - t0
    trainer.close()
    if world.rank == 0:
        print(json.dumps({"setting": a.worker, "per_step_ms": wall / a.steps * 1e3}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--mpiexec", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    p.add_argument("--worker", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    names = list(SETTINGS)
    runs = {n: [] for n in names}
    for r in range(a.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            cmd = [a.mpiexec, "-n", str(a.ranks), sys.executable, os.path.abspath(__file__), "--worker", name,
                   "--steps", str(a.steps)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode or not lines:
                raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
            runs[name].append(json.loads(lines[-1])["per_step_ms"])
    print(f"digits MLP, {a.ranks} ranks (dp), {a.steps} steps, {a.repeats} launches each, CPU backend")
    base = statistics.median(runs["off"])
    for name in names:
        med = statistics.median(runs[name])
        print(f"  {name:12s} {med:7.3f} ms/step (runs {' '.join(f'{x:.3f}' for x in runs[name])})  "
              f"{med / base:5.2f}x off")


if __name__ == "__main__":
    main()
