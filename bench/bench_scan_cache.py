"""Start-up time with a large token file: the first start scans every token, a second start of the unchanged file
reads a record instead (hpctrain/scan_cache.py).

    python bench/bench_scan_cache.py                 # a 1 GB token file (uint16 ids), 2 ranks
    python bench/bench_scan_cache.py --gb 0.25 -n 4
    python bench/bench_scan_cache.py --drop-caches   # as root: each start reads the disk, not the page cache
    python bench/bench_scan_cache.py --drop-caches --before c50ff05^   # also the start-up before the record

Run it plainly: it writes the token file in a temporary folder, then launches ``mpiexec -n N`` of this file
with --worker, twice, with a fresh record folder (HPCTRAIN_CACHE_DIR): each launch builds the real Trainer
(the gpt-char model, CPU backend) and its rank 0 prints each rank's Trainer construction time (the largest of
the ranks: the start-up every rank waits for), whole and less the compute backend's construction (on the CPU,
numba's import: the same with any data file or none). Target (issue 28): the second start ≤ 1/4 of the
start-up before the record existed. ``--before REV`` measures that one too: this file run from a copy of the git
revision REV (``c50ff05^``, the last without the record: every rank scanned the whole file, and each kept
the whole epoch permutation), once to compile its kernels, then timed like the other two starts.

Figure: start-up with a large token file, first start against second; docs/performance.md, "Start-up" (every run
behind it: docs/performance-log.md).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def worker(a):
    from mpi4py import MPI

    from hpctrain.config import load_config
    from hpctrain.train import Trainer

    cfg = load_config(os.path.join(HERE, "..", "jobs", "configs", "gpt-char.toml"),
                      [f"data.path={a.path}", "data.corpus=", "train.metrics=", "checkpoint.dir=", "train.steps=1",
                       "model.vocab_size=256", "train.backend=cpu"])
    from hpctrain.train import startup

    backend_s = []  # the compute backend's construction (numba's import on the CPU), the same for any data file
    get_backend = startup.get_backend

    def timed_backend(*args, **kwargs):
        t = time.perf_counter()
        try:
            return get_backend(*args, **kwargs)
        finally:
            backend_s.append(time.perf_counter() - t)

    startup.get_backend = timed_backend
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    t = Trainer(cfg, log=lambda *x: None)
    took = time.perf_counter() - t0
    t.close()
    times = MPI.COMM_WORLD.gather((took, sum(backend_s)), root=0)
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps({"times": [x for x, _ in times], "backend": [b for _, b in times]}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="token file size in GB (uint16 ids)")
    p.add_argument("-n", type=int, default=2, help="ranks")
    p.add_argument("--mpiexec", default="mpiexec")
    p.add_argument("--drop-caches", action="store_true", help="empty the page cache before each start (root)")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--path")
    p.add_argument("--before", metavar="REV", help="also time the start-up of git revision REV (c50ff05^)")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    import h5py
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-scan-") as d:
        path = os.path.join(d, "tokens.h5")
        n = int(a.gb * 1e9) // 2
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        with h5py.File(path, "w") as f:
            dset = f.create_dataset("tokens", shape=(n,), dtype=np.uint16, chunks=True)
            step = 1 << 26
            for lo in range(0, n, step):
                dset[lo : min(n, lo + step)] = rng.integers(0, 200, min(n, lo + step) - lo, dtype=np.uint16)
            dset.attrs["vocabulary"] = np.arange(200, dtype=np.int32) + 32
        print(f"token file: {os.path.getsize(path) / 1e9:.2f} GB ({n:,} uint16 ids), written in "
              f"{time.perf_counter() - t0:.1f} s")
        env = dict(os.environ, HPCTRAIN_CACHE_DIR=os.path.join(d, "cache"), OMP_NUM_THREADS="1")
        launch = shlex.split(a.mpiexec) + ["-n", str(a.n), sys.executable]
        cmd = launch + [os.path.abspath(__file__), "--worker", "--path", path]
        starts = [("first start (scan)", cmd), ("second start (record)", cmd)]
        if a.before:
            from common import extract_revision

            old = extract_revision(a.before, os.path.join(d, "before"))
            os.makedirs(os.path.join(old, "bench"), exist_ok=True)
            copy = os.path.join(old, "bench", os.path.basename(__file__))  # imports hpctrain from the copy
            with open(__file__) as src, open(copy, "w") as dst:
                dst.write(src.read())
            old_cmd = launch + [copy, "--worker", "--path", path]
            run_start(old_cmd, env, False)  # compiles its kernels into its numba cache
            starts.insert(0, (f"before the record ({a.before})", old_cmd))
        results, rests = [], []
        for label, c in starts:
            times, backend = run_start(c, env, a.drop_caches)
            rest = [x - b for x, b in zip(times, backend)]
            results.append(max(times))
            rests.append(max(rest))
            print(f"{label}: Trainer construction {', '.join(f'{x:.2f}' for x in times)} s on the {a.n} ranks; "
                  f"less the backend's (numba's import, {', '.join(f'{b:.2f}' for b in backend)} s): "
                  f"{', '.join(f'{x:.3f}' for x in rest)} s")
        print(f"second / first: {results[-1] / results[-2]:.3f}; less the backend: {rests[-1] / rests[-2]:.3f}")
        if a.before:
            print(f"second / before the record: {results[-1] / results[0]:.3f}; less the backend: "
                  f"{rests[-1] / rests[0]:.3f} (target <= 0.25)")


def run_start(cmd, env, drop_caches):
    """One launch's Trainer construction seconds per rank, and the backend's share of each."""
    if drop_caches:  # each start reads from the disk, as on a shared file system the page cache does not hold
        subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    got = json.loads(lines[-1])
    return got["times"], got["backend"]


if __name__ == "__main__":
    main()
