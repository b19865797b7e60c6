"""A later micro-batch's weight gradient: added inside the GEMM (beta = 1) against a temporary and an add.

    OMP_NUM_THREADS=1 python bench/bench_accumulate.py
    OMP_NUM_THREADS=1 python bench/bench_accumulate.py --repeat 50

For each shape, ``CpuBackend.matmul_tn`` (out[M,N] (+)= a[K,M]ᵀ·b[K,N]) timed three ways in one run, one
after another, the median of ``--repeat`` calls each: writing the product (the first micro-batch), adding it through numpy's
BLAS with beta = 1 (backend/cpu/blas.py; what a later micro-batch runs), and adding it through a temporary and a
second pass (what it ran before, and the fallback where numpy's BLAS is not found). The shapes: a Linear
of the pipeline benchmark (64 rows, 1024 and 2048 wide), a gpt-char projection (K = B·T = 2048), and a
GPT-2-small token table tied to the head (768 × 50257, 64 rows: 154 MB of gradient).

Figure: the time of a later micro-batch's weight gradient added inside the GEMM, against a temporary and an add;
docs/performance.md, "CPU step" (every run behind it: docs/performance-log.md).
"""

import argparse
import os
import sys
import time

import hpctrain  # noqa: F401  (first: it shares the cores between the ranks before numpy starts BLAS)
import numpy as np

from hpctrain.backend.cpu import CpuBackend

SHAPES = [(64, 1024, 1024, "Linear 1024x1024, 64 rows"), (64, 2048, 2048, "Linear 2048x2048, 64 rows"),
          (2048, 384, 128, "gpt-char c_fc (K = B*T)"), (64, 50257, 768, "GPT-2 tied token table, 64 rows")]


def median_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    be, fallback = CpuBackend(), CpuBackend()
    fallback._sgemm = None
    if be._sgemm is None:
        sys.exit("numpy's BLAS has no cblas_sgemm this finds: the backend uses the temporary and add (nothing to compare)")
    print(f"BLAS symbol {be._sgemm.name}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"median of {a.repeat}")
    print(f"{'shape':>34} {'write ms':>9} {'beta=1 ms':>10} {'temp+add ms':>12} {'beta=1/write':>13} "
          f"{'temp+add/write':>15}")
    rng = np.random.default_rng(0)
    for K, M, N, name in SHAPES:
        x = rng.standard_normal((K, M), dtype=np.float32)
        dy = rng.standard_normal((K, N), dtype=np.float32)
        out = np.zeros((M, N), dtype=np.float32)
        write = median_ms(lambda: be.matmul_tn(x, dy, out), a.repeat)
        beta1 = median_ms(lambda: be.matmul_tn(x, dy, out, accumulate=True), a.repeat)
        temp = median_ms(lambda: fallback.matmul_tn(x, dy, out, accumulate=True), a.repeat)
        print(f"{name:>34} {write:9.3f} {beta1:10.3f} {temp:12.3f} {beta1 / write:13.3f} {temp / write:15.3f}")


if __name__ == "__main__":
    main()
