"""The parameter server's peak memory against the number of workers (issue 28): it must not grow with W.

    python bench/bench_ps_memory.py                          # W = 2, 4, 8 workers, 1 server, staleness 2
    python bench/bench_ps_memory.py --workers 2 4 --hidden 2048 --pythonpath /path/to/other/checkout
    python bench/bench_ps_memory.py --workers 2 --servers 2 --checkpoint   # the servers' peak while saving
    python bench/bench_ps_memory.py --workers 2 6 --layers 3 --steps 40 --checkpoint    # issue 51's 8.5 M MLP

Runs ``hpctrain train jobs/configs/digits-ps.toml`` under ``mpiexec -n W+S`` (S servers, 1 unless --servers;
oversubscribed on a small machine) with the digits MLP widened to --hidden (--layers hidden layers, 2 unless
given: about 4.3 M parameters at 2048, 17 MB a copy; 3: 8.5 M, 34 MB), --steps steps, no metrics file, and no
checkpoint (--checkpoint: one every --steps / 2 steps and the final one, as a run with ``checkpoint.dir`` writes
them). Every rank runs under ``/usr/bin/time -f %M``; each W's line gives the server's (world rank 0; with
--servers S, the largest of ranks 0 .. S-1) peak RSS, the largest worker's, the copies of its range the server
held at most, the run's wall time and how stale its gradients were; the last line the server's growth per added
worker and its ratio from the first W to the last. --pythonpath runs another checkout's hpctrain (a
before/after comparison in one run).

Figure: the parameter server's peak RSS against the number of workers; docs/performance.md, "Parameter server"
(every run behind it: docs/performance-log.md).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "jobs", "configs", "digits-ps.toml")

WRAPPER = """#!/bin/bash
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}
exec /usr/bin/time -f %M -o "$RSS_DIR/rank-$rank" "$@"
"""


OTHER = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_EditableFinder' and "
         "getattr(f, '__name__', '') != '_EditableFinder']; sys.path.insert(0, {path!r}); import hpctrain; "
         "assert hpctrain.__file__.startswith({path!r}), hpctrain.__file__; from hpctrain.cli import main; "
         "sys.exit(main(sys.argv[1:]))")


def run(workers, args):
    layers = "[" + ", ".join(f"{{type = \"linear\", in = {a}, out = {b}}}, {{type = \"relu\"}}"
                             for a, b in zip(args.shape[:-1], args.shape[1:-1])) \
        + f", {{type = \"linear\", in = {args.shape[-2]}, out = 10}}]"
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = os.path.join(tmp, "rss.sh")
        with open(wrapper, "w") as f:
            f.write(WRAPPER)
        os.chmod(wrapper, 0o755)
        env = dict(os.environ, RSS_DIR=tmp, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        # another checkout: ahead of an editable install's finder, which would otherwise win over sys.path
        start = ["-c", OTHER.format(path=args.pythonpath)] if args.pythonpath else ["-m", "hpctrain"]
        cmd = [args.mpiexec, "-n", str(workers + args.servers), wrapper, sys.executable, *start, "train", CONFIG,
               "--set", f"model.layers={layers}", "--set", f"train.steps={args.steps}",
               "--set", f"train.batch_size={8 * workers}", "--set", f"parallel.staleness={args.staleness}",
               "--set", f"parallel.servers={args.servers}",
               "--set", f"checkpoint.dir={os.path.join(tmp, 'ck') if args.checkpoint else ''}",
               "--set", f"checkpoint.every={max(1, args.steps // 2)}", "--set", "train.metrics=",
               "--set", "train.eval_every=0",
               "--set", f"train.log_every={args.steps}"]
        began = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - began
        if proc.returncode:
            raise SystemExit(f"W = {workers}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        rss = {int(n.split("-")[1]): int(open(os.path.join(tmp, n)).read().split()[-1]) / 1024
               for n in os.listdir(tmp) if n.startswith("rank-")}
        summary = ([line for line in proc.stdout.splitlines() if "server_snapshots_max" in line] or [""])[-1]

        def figure(name):
            return summary.split(f"{name} ")[1].split(",")[0] if f"{name} " in summary else "n/a"

        return (max(v for r, v in rss.items() if r < args.servers), max(v for r, v in rss.items() if r >= args.servers),
                figure("server_snapshots_max"), f"{wall:.1f} s launch to exit, gradients up to "
                f"{figure('update_lag_max')} updates old (mean {figure('update_lag_mean')})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2, help="hidden layers, each --hidden wide (3: 8.5 M parameters)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--pythonpath", default="", help="run the hpctrain found here (another checkout)")
    p.add_argument("--checkpoint", action="store_true", help="write checkpoints (every --steps / 2 steps)")
    p.add_argument("--servers", type=int, default=1, help="parameter servers (world ranks 0 .. servers - 1)")
    p.add_argument("--mpiexec", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    args = p.parse_args()
    args.shape = [64] + [args.hidden] * args.layers + [10]
    params = sum(a * b + b for a, b in zip(args.shape[:-1], args.shape[1:]))
    print(f"digits MLP {'-'.join(map(str, args.shape))}: {params:,} parameters ({params * 4 / 2**20:.1f} MiB a "
          f"copy); staleness {args.staleness}, {args.steps} steps{', checkpoints' if args.checkpoint else ''}; "
          f"hpctrain from {args.pythonpath or 'this checkout'}")
    rows = []
    for w in args.workers:
        server, worker, peak, how = run(w, args)
        rows.append((w, server))
        print(f"W = {w}: server peak RSS {server:,.0f} MB (the largest of {args.servers}), largest worker "
              f"{worker:,.0f} MB, server snapshots at most {peak}; {how}", flush=True)
    (w0, s0), (w1, s1) = rows[0], rows[-1]
    print(f"server growth per added worker: {(s1 - s0) / max(1, w1 - w0):+.1f} MB "
          f"({(s1 - s0) / max(1, w1 - w0) / (params * 4 / 2**20):+.2f} copies of the parameters); "
          f"W = {w1} / W = {w0}: {s1 / s0:.2f}x")


if __name__ == "__main__":
    main()
