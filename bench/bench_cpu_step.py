"""CPU backend: Linear forward+backward and one MLP training step against numpy's GEMM time.

    python bench/bench_cpu_step.py                     # batch 256, hidden 1024 (the target shape)
    python bench/bench_cpu_step.py --batch 512 --hidden 2048

1. Linear forward+backward (X·Wᵀ+b, dY·W, dYᵀ·X, bias grad) through the backend against
   the three bare ``numpy.matmul`` calls on the same shapes: GFLOP/s and the ratio.
2. One MLP training step (in → hidden → hidden → hidden → 10, ReLU, the real
   ``Trainer.train_step``: HDF5 read, forward, cross-entropy, backward, grad norm,
   optimizer) against the sum of the step's GEMMs timed with ``numpy.matmul``.
   Target: step ≤ 1.25 × GEMM time at batch 256, hidden 1024.

Figure: the MLP step / the sum of its GEMMs, and Linear GFLOP/s against numpy; docs/performance.md, "CPU step"
(every run behind it: docs/performance-log.md).
"""

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import best_of, mlp_config, synthetic_classification  # noqa: E402

from hpctrain.backend.cpu import CpuBackend  # noqa: E402
from hpctrain.parallel.mesh import Mesh  # noqa: E402
from hpctrain.nn import Linear  # noqa: E402
from hpctrain.train import Trainer  # noqa: E402


def bench_linear(be, B, K, N, repeat):
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in [(B, K), (N, K), (N,)])
    dout = rng.standard_normal((B, N)).astype(np.float32)
    layer = Linear(K, N)
    layer.bind({"weight": w, "bias": b}, {"weight": np.empty_like(w), "bias": np.empty_like(b)})

    def hpctrain_step():
        _, saved = layer.forward(be, x)
        layer.backward(be, dout, saved)

    def numpy_gemms():
        np.matmul(x, w.T)
        np.matmul(dout, w)
        np.matmul(dout.T, x)

    flops = 3 * 2 * B * K * N
    t_h, t_n = best_of(hpctrain_step, repeat), best_of(numpy_gemms, repeat)
    print(f"linear B={B} in={K} out={N}: hpctrain fwd+bwd {flops / t_h / 1e9:7.1f} GFLOP/s, "
          f"numpy GEMMs {flops / t_n / 1e9:7.1f} GFLOP/s, ratio (time) {t_h / t_n:.3f}")


def gemm_time(sizes, B, repeat):
    """The step's GEMMs: forward X·Wᵀ per layer, dW per layer, dX for every layer but the first."""
    rng = np.random.default_rng(0)
    calls = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in [(B, a), (b, a), (B, b)])
        calls.append(lambda x=x, w=w: np.matmul(x, w.T))
        calls.append(lambda x=x, dy=dy: np.matmul(dy.T, x))
        if i > 0:
            calls.append(lambda w=w, dy=dy: np.matmul(dy, w))
    return best_of(lambda: [c() for c in calls], repeat)


def bench_step(B, hidden, features, optim, repeat):
    sizes = [features, hidden, hidden, hidden, 10]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "d.h5")
        synthetic_classification(path, 4 * B, features, 10)
        trainer = Trainer(mlp_config(path, sizes, B, optim), mesh=Mesh(), log=lambda *a: None)
        step = [0]

        def one_step():
            trainer.train_step(step[0], 1e-3)
            step[0] += 1

        t_step = best_of(one_step, repeat, warmup=2)
        trainer.close()
    t_gemm = gemm_time(sizes, B, repeat)
    print(f"MLP step {'-'.join(map(str, sizes))} batch {B} {optim}: step {t_step * 1e3:.2f} ms, "
          f"its GEMMs {t_gemm * 1e3:.2f} ms, ratio {t_step / t_gemm:.3f} (target <= 1.25)")
    return t_step / t_gemm


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=10)
    a = p.parse_args()
    be = CpuBackend()
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, cores {os.cpu_count()}")
    for K, N in [(a.features, a.hidden), (a.hidden, a.hidden)]:
        bench_linear(be, a.batch, K, N, a.repeat)
    for optim in ("sgd", "adamw"):
        bench_step(a.batch, a.hidden, a.features, optim, a.repeat)


if __name__ == "__main__":
    main()
