"""Async parameter server against sync data parallel: wall time to a target accuracy, with and without a straggler.

    python bench/bench_param_server.py                    # W = 2 workers, 600 steps, 3 alternating repeats,
                                                          # async at staleness 2 and 256
    python bench/bench_param_server.py --repeats 2 --steps 400 --mpiexec "mpiexec -bind-to core"
    python bench/bench_param_server.py --hidden 1024 --steps 300     # heavier steps: messaging matters less

Run it plainly (not under mpiexec): it starts its ranks itself, re-invoking this file with --worker,
one BLAS thread per rank. The job is the digits MLP of jobs/configs/digits-ps.toml (its model, data,
global batch 64, AdamW and cosine schedule; CPU backend, no metrics file, no checkpoint, no
evaluation but the final one), trained for a fixed --steps, enough for both modes to reach the
target validation accuracy (0.95; each run's final val_accuracy is printed beside its time):

  sync   ``mpiexec -n W``: the Trainer with parallel.mode = "sync", dp = W, the same global batch;
  async  ``mpiexec -n W+1``: the AsyncTrainer, 1 server (world rank 0) and W workers, at each
         --staleness bound; the step budget is global: --steps · W gradients of 1/W of the global
         batch (as many samples as sync), whichever workers compute them.

each without and with one straggler: world rank 1 (a sync rank, or the first async worker) sleeps
after each training step half of that step's own time (busy + data + optimizer seconds that
StageExecutor.run reports, its waits on the other ranks left out): StageExecutor.run is wrapped on
that rank only, and only calls with on_optimizer_step (training steps, not evaluation) sleep.
Wall time: trainer.run() between two world Barriers (training and the final evaluation; start-up
left out). The four configurations alternate, the order rotating each repeat; figures are medians.

Targets (issue 11): with the straggler, async wall time < sync wall time; without it, async within
1.25x of sync. A straggler slowed for the whole run gains async nothing under a tight bound (the
others wait for it once they are k steps ahead), so the default runs a tight bound (2) and a loose
one (256, more than the lead a 1.5x slower worker builds in 600 steps). Note: async uses one rank
more than sync (the server), so on a 2-core machine its 3 ranks oversubscribe the cores while
sync's 2 ranks do not; the CPU seconds each rank used are printed to show where the time went.

Figure: async parameter server / sync data parallel, wall time to a target accuracy; docs/performance.md,
"Parameter server" (every run behind it: docs/performance-log.md).
"""

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "jobs", "configs", "digits-ps.toml")
TARGET = 0.95


def add_straggler(sleeps):
    """Wrap StageExecutor.run in this process: after each training step, sleep half of its own time."""
    from hpctrain.parallel.executor import StageExecutor

    original = StageExecutor.run

    def run(self, *args, **kwargs):
        r = original(self, *args, **kwargs)
        if kwargs.get("on_optimizer_step") is not None:
            pause = 0.5 * (r.busy + r.data + r.optim)
            time.sleep(pause)
            sleeps.append(pause)
        return r

    StageExecutor.run = run


def worker(a):
    """One launch (collective over COMM_WORLD); world rank 0 prints one JSON line."""
    from mpi4py import MPI

    from hpctrain.config import load_config

    world = MPI.COMM_WORLD
    overrides = ['train.backend="cpu"', 'train.metrics=""', 'checkpoint.dir=""', 'checkpoint.resume="never"',
                 "train.eval_every=0", f"train.steps={a.steps}", f'parallel.mode="{"async_ps" if a.worker == "async" else "sync"}"',
                 "parallel.servers=1", f"parallel.staleness={a.staleness[0] if a.worker == 'async' else 0}"]
    if a.hidden:  # a heavier step: the digits MLP with wider hidden layers
        h = a.hidden
        overrides.append(f'model.layers=[{{type="linear",in=64,out={h}}},{{type="relu"}},{{type="linear",in={h},'
                         f'out={h}}},{{type="relu"}},{{type="linear",in={h},out=10}}]')
    cfg = load_config(CONFIG, overrides)
    sleeps = []
    if a.straggler and world.rank == 1:
        add_straggler(sleeps)
    quiet = lambda *args, **kwargs: None  # noqa: E731
    if a.worker == "async":
        from hpctrain.train.async_ps import AsyncTrainer

        trainer, mesh = AsyncTrainer(cfg, log=quiet), None
    else:
        from hpctrain.parallel.mesh import Mesh
        from hpctrain.train import Trainer

        mesh = Mesh(dp=world.size)
        trainer = Trainer(cfg, mesh=mesh, log=quiet)
    world.Barrier()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime
    t0 = time.perf_counter()
    summary = trainer.run()
    world.Barrier()
    wall = time.perf_counter() - t0
    trainer.close()
    if mesh is not None:
        mesh.free()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = world.gather(usage.ru_utime + usage.ru_stime - cpu0, root=0)
    sleep = world.bcast(statistics.mean(sleeps) if sleeps else 0.0, root=1)
    if world.rank == 0:
        print(json.dumps({"mode": a.worker, "straggler": a.straggler, "ranks": world.size, "wall": wall,
                          "val_accuracy": summary.get("val_accuracy"), "sleep": sleep,
                          "updates_per_worker": summary.get("updates_per_worker"),
                          "worker_idle_s": summary.get("worker_idle_s"), "cpu_s": cpu,
                          "mpi": MPI.Get_library_version().splitlines()[0].strip()}), flush=True)


def launch(a, mode, k, straggler, env):
    n = a.workers + (1 if mode == "async" else 0)
    cmd = shlex.split(a.mpiexec) + ["-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", mode,
                                    "--steps", str(a.steps), "--staleness", str(k), "--hidden", str(a.hidden)]
    cmd += ["--straggler"] if straggler else []
    p = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="launches of each configuration")
    p.add_argument("--steps", type=int, default=600, help="train.steps (per worker in async mode)")
    p.add_argument("--workers", type=int, default=2, help="W: sync ranks, async workers (plus 1 server)")
    p.add_argument("--staleness", type=int, nargs="+", default=[2, 256], help="async bounds to run")
    p.add_argument("--hidden", type=int, default=0, help="hidden width (0: the config's 128); wider = heavier steps")
    p.add_argument("--mpiexec", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    p.add_argument("--worker", choices=("sync", "async"), help=argparse.SUPPRESS)
    p.add_argument("--straggler", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    configs = [(m, k, s) for s in (False, True) for m, k in [("sync", 0)] + [("async", k) for k in a.staleness]]
    runs = {c: [] for c in configs}
    for r in range(a.repeats):
        for c in configs[r % len(configs):] + configs[: r % len(configs)]:
            runs[c].append(launch(a, *c, env))
    W, cores = a.workers, os.cpu_count()
    print(f"{runs[configs[0]][0]['mpi']}; launcher {a.mpiexec!r}; BLAS threads per rank 1; {cores} cores; "
          f"python {sys.version.split()[0]}")
    print(f"digits MLP (digits-ps.toml{f', hidden {a.hidden}' if a.hidden else ''}), global batch 64, {a.steps} "
          f"steps, CPU; {a.repeats} launches per configuration")
    print(f"sync: -n {W} (dp {W}); async: -n {W + 1} (1 server + {W} workers) -- one rank more"
          + (f"; {W + 1} ranks on {cores} cores: OVERSUBSCRIBED" if W + 1 > cores else ""))
    med = {}
    for (mode, k, straggler), rs in runs.items():
        med[mode, k, straggler] = statistics.median(x["wall"] for x in rs)
        accs = [x["val_accuracy"] for x in rs]
        cpu = [statistics.median(x["cpu_s"][i] for x in rs) for i in range(len(rs[0]["cpu_s"]))]
        name = f"{mode} k={k}" if mode == "async" else mode
        line = (f"  {name:11} {'straggler' if straggler else 'no straggler':12}: wall {med[mode, k, straggler]:5.2f} s "
                f"(runs {' '.join(f'{x:.2f}' for x in sorted(x['wall'] for x in rs))}); CPU s per rank "
                f"{' '.join(f'{c:.2f}' for c in cpu)}; val_accuracy {min(accs):.4f}-{max(accs):.4f} "
                f"({'all' if all(v >= TARGET for v in accs) else 'NOT all'} >= {TARGET})")
        if mode == "async":
            line += (f"; steps/worker {rs[-1]['updates_per_worker']}, worker idle s "
                     f"{statistics.median(sum(x['worker_idle_s']) for x in rs):.2f}")
        if straggler:
            line += f"; straggler sleeps {statistics.median(x['sleep'] for x in rs) * 1e3:.2f} ms/step"
        print(line)
    for k in a.staleness:
        plain, slow = med["async", k, False] / med["sync", 0, False], med["async", k, True] / med["sync", 0, True]
        print(f"  async k={k} / sync: no straggler {plain:.2f} (target <= 1.25: {'met' if plain <= 1.25 else 'MISSED'}), "
              f"straggler {slow:.2f} (target < 1: {'met' if slow < 1 else 'MISSED'}); the straggler slows sync "
              f"{med['sync', 0, True] / med['sync', 0, False]:.2f}x, async {med['async', k, True] / med['async', k, False]:.2f}x")

if __name__ == "__main__":
    main()
