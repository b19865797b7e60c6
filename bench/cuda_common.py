"""Shared bits of the CUDA benchmarks: GPU detection, event timing, correctness checks.

Every script exits 0 with a clear message where there is nothing to measure (no
GPU, no PyTorch/CuPy). Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the
scripts check correctness on tiny shapes and time nothing.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def gpu_mode(what: str) -> str:
    """'gpu', or 'sim' under the simulator; without either, say so and exit 0."""
    try:
        from numba import cuda
    except ImportError:
        print(f"{what}: numba-cuda is not installed (pip install hpctrain[cuda]); nothing to measure")
        sys.exit(0)
    from hpctrain.backend.cuda import simulator

    if simulator():
        print(f"{what}: CUDA simulator: checking correctness on tiny shapes, timing nothing")
        return "sim"
    if not cuda.is_available():
        print(f"{what}: no CUDA GPU visible to numba (check nvidia-smi); nothing to measure")
        sys.exit(0)
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    print(f"{what}: {name}, compute capability {'.'.join(map(str, dev.compute_capability))}")
    return "gpu"


def time_kernel(fn, *, repeat=5, number=10, warmup=2, stream=0):
    """Best seconds per call of ``fn`` (which enqueues GPU work on ``stream``), timed with CUDA events.

    ``number`` calls go between two events, so the host-side launch overhead of one call
    overlaps the GPU work of the previous one, as it does in a training step.
    """
    from numba import cuda

    for _ in range(warmup):
        fn()
    cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start, stop = cuda.event(), cuda.event()
        start.record(stream)
        for _ in range(number):
            fn()
        stop.record(stream)
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / 1e3 / number)  # elapsed_time is in milliseconds
    return best


def check(name, got, want, *, rtol=1e-4, atol=1e-4) -> None:
    """Exit 1 naming the variant if ``got`` differs from ``want`` (a wrong kernel is never timed)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want) / (atol + rtol * np.abs(want))
    if got.shape != want.shape or not np.all(err <= 1):
        worst = np.unravel_index(np.argmax(err), err.shape) if got.shape == want.shape else None
        print(f"FAIL {name}: result differs from the reference"
              + (f" (worst at {worst}: {got[worst]} vs {want[worst]})" if worst is not None else
                 f" (shape {got.shape} vs {want.shape})"))
        sys.exit(1)


def random_operands(M, K, N, seed=0):
    """a[M,K], b[N,K] float32 (the X·Wᵀ layout) and the float64 reference a·bᵀ."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    return a, b, a.astype(np.float64) @ b.astype(np.float64).T


def gemm_tolerance(K):
    """float32 accumulation error grows with K; the relative check uses this atol/rtol."""
    return dict(rtol=1e-4, atol=2e-5 * np.sqrt(K) * 4)


def gflops(M, N, K, seconds):
    return 2.0 * M * N * K / seconds / 1e9
