"""The schedule executor against the fused data-parallel step it replaced, in the same run.

    python bench/bench_step_overhead.py                   # one process
    mpiexec -n 2 python bench/bench_step_overhead.py      # data parallel on 2 ranks

Until the step became a schedule, ``Trainer._train_step`` ran data reads, forward,
loss, backward with the bucketed-Allreduce hooks, the norm, clipping and the optimizer
in one function. ``fused_step`` below is that function, written against today's
objects (the same model part, gradient sync, optimizer and data) so both paths do the
same arithmetic. Steps alternate between the two (same trainer, same batches, each
going first every other time), so drift in the machine's load hits both alike; the ratio is fused time / executor time
(target >= 0.97: the executor may not make data-parallel training slower).

Figure: the schedule executor's step / the fused step it replaced; docs/performance.md, "Data parallel" (every run
behind it: docs/performance-log.md).
"""

import argparse
import math
import os
import shutil
import sys
import time

import hpctrain  # noqa: F401  (first: it shares the cores between the ranks before numpy starts BLAS)
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mlp_config, shared_tempdir, synthetic_classification  # noqa: E402

from hpctrain.optim import clip_coefficient  # noqa: E402
from hpctrain.parallel.mesh import Mesh  # noqa: E402
from hpctrain.train import Trainer  # noqa: E402


def fused_step(t, step, lr):
    """The pre-schedule data-parallel step, as it was: one loop over the micro-batches, then the update."""
    be, m = t.be, t.cfg.train.micro_batches
    rows = t.sampler.local_rows(step)
    per = len(rows) // m
    scale = t.runner.grad_scale
    t.sync.start_step()
    for i in range(m):
        x, y = t.data.read(rows[i * per : (i + 1) * per])
        x, y = be.asarray(x), be.asarray(y)
        out, saved = t.part.forward(be, x)
        _, _, dout = t.loss(be, out, y, scale)
        t.part.backward(be, dout, saved, accumulate=i > 0, need_dinp=False,
                        on_final=t.sync.grads_final if i == m - 1 else None)
    t.sync.wait()
    norm = math.sqrt(be.sum_squares(t.grads.data))
    coef = clip_coefficient(norm, t.cfg.train.grad_clip)
    if coef < 1.0:
        be.scale_(t.grads.data, coef)
    t.optim.step(lr)
    be.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--bucket-mb", type=float, default=4)
    a = p.parse_args()
    mesh = Mesh()
    folder = shared_tempdir(mesh.world)
    path = os.path.join(folder, "d.h5")
    sizes = [1024, a.hidden, a.hidden, a.hidden, 10]
    if mesh.rank == 0:
        synthetic_classification(path, 8 * a.batch, sizes[0], sizes[-1])
    mesh.world.Barrier()
    cfg = mlp_config(path, sizes, a.batch, "sgd", micro_batches=a.micro)
    t = Trainer(cfg, mesh=mesh, log=lambda *x: None)
    times = {"executor": [], "fused": []}
    for s in range(a.steps + 3):
        for kind in ("executor", "fused") if s % 2 else ("fused", "executor"):  # neither always goes first
            mesh.world.Barrier()
            t0 = time.perf_counter()
            t.train_step(s, 1e-4) if kind == "executor" else fused_step(t, s, 1e-4)
            if s >= 3:
                times[kind].append(time.perf_counter() - t0)
    t.close()
    mesh.world.Barrier()
    if mesh.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        ex, fu = np.median(times["executor"]), np.median(times["fused"])
        print(f"{MPI.Get_library_version().splitlines()[0].strip()}; {mesh.describe()}; MLP {'-'.join(map(str, sizes))} "
              f"batch {a.batch}, {a.micro} micro-batch(es), {a.steps} alternating steps: executor {ex * 1e3:.2f} ms, "
              f"fused {fu * 1e3:.2f} ms, ratio fused/executor {fu / ex:.3f} (target >= 0.97)", flush=True)
    mesh.free()


if __name__ == "__main__":
    main()
