"""Each rank's memory while loading a checkpoint on another tensor-parallel size.

    python bench/bench_reshard_memory.py                 # 2 ranks: write at pp 2, load at tp 2
    python bench/bench_reshard_memory.py --before db86172

An MLP 256-4096-4096-4096-4096-10 with AdamW is trained one step at pp = N and checkpointed; then a fresh
``mpiexec -n N`` loads it at tp = N (the row-parallel weights and their Adam slots are stored by rows and
traded for columns). Each loading rank runs under ``/usr/bin/time -f %M``; printed beside its peak RSS is
what it holds of parameters and optimizer slots. ``--before REV`` loads with git revision REV too.

Figure: each rank's peak RSS while loading at another tensor-parallel size; docs/performance.md, "Checkpoints"
(every run behind it: docs/performance-log.md).
"""

import argparse
import dataclasses
import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))


def config(base, pp, tp, ck, resume):
    from common import mlp_config

    c = mlp_config(f"{base}/d.h5", [256, 4096, 4096, 4096, 4096, 10], 8, optim="adamw")
    return dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, pp=pp, tp=tp),
                               train=dataclasses.replace(c.train, steps=1),
                               checkpoint=dataclasses.replace(c.checkpoint, dir=ck, every=1, resume=resume, async_=False))


def worker(mode, base):
    sys.path.insert(0, HERE)
    from mpi4py import MPI

    from common import synthetic_classification
    from hpctrain.train import Trainer

    comm = MPI.COMM_WORLD
    if mode == "write":
        if comm.rank == 0:
            synthetic_classification(f"{base}/d.h5", 256, 256, 10)
        comm.Barrier()
        t = Trainer(config(base, comm.size, 1, f"{base}/ck", "auto"), log=lambda *a: None)
        t.run()
        t.close()
        return
    path = sorted(glob.glob(f"{base}/ck/ckpt-*.h5"))[-1]
    t = Trainer(config(base, 1, comm.size, f"{base}/ck-" + os.path.basename(os.path.dirname(HERE)), path), log=lambda *a: None)
    held = 4 * (t.part.owned_size + sum(b.layout.size for b in t.optim.slots.values()))
    print(f"holds {held / 1e6:.0f} MB of parameters and slots", flush=True)
    t.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--before", metavar="REV")
    p.add_argument("--worker", nargs=2, metavar=("MODE", "BASE"))
    a = p.parse_args()
    if a.worker:
        return worker(*a.worker)
    sys.path.insert(0, HERE)
    from common import extract_revision

    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-reshard-") as d:
        trees = [("now", ROOT)] + ([(a.before, extract_revision(a.before, f"{d}/before"))] if a.before else [])
        subprocess.run([mpiexec, "-n", str(a.n), sys.executable, __file__, "--worker", "write", d], check=True)
        for label, tree in trees:
            script = os.path.join(tree, "bench", "bench_reshard_memory.py")
            if tree != ROOT:  # this script, run from the revision's tree
                with open(__file__) as src, open(script, "w") as dst:
                    dst.write(src.read())
            cmd = [mpiexec, "-n", str(a.n), "sh", "-c",
                   f'exec /usr/bin/time -f "rank ${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}: peak RSS %M KB" '
                   f'"{sys.executable}" "{script}" --worker load "{d}"']
            out = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
            lines = sorted(ln for ln in (out.stdout + out.stderr).splitlines() if "peak RSS" in ln or "holds" in ln)
            print(f"{label}: " + "; ".join(lines))


if __name__ == "__main__":
    main()
