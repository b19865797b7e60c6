"""The Adam update as a numba.njit kernel, compiled with and without what lets LLVM vectorise it.

    python bench/history/cpu_adam_variants.py               # 3.16 M parameters (the bench_cpu_step MLP)

Variant 1 uses numba's default error model ("python": a division by zero raises, so every
division keeps a check and the loop stays scalar); variant 2 is the library's choice,
error_model="numpy". Both are checked against each other before timing.
"""

import argparse
import time

import numba
import numpy as np

from hpctrain.backend.cpu.optim import _adam_update


def make(**options):
    """The library's own Adam kernel source (cpu._adam_update), compiled with ``options``."""
    return numba.njit(**options)(_adam_update.py_func)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=3_160_000)
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    initial = [rng.random(a.n, dtype=np.float32) for _ in range(4)]
    f32 = np.float32
    scalars = (f32(1e-3), f32(0.9), f32(0.999), f32(1 - 0.9), f32(1 - 0.999), f32(0.5), f32(1e-8), f32(0.0), f32(1.0))
    variants = [("1 error_model=python (default)", make()), ("2 error_model=numpy (library)", make(error_model="numpy"))]
    outputs, times = [], []
    for _, kernel in variants:
        bufs = [b.copy() for b in initial]
        args = (bufs[0], bufs[1], f32(1.0), *bufs[2:], *scalars)  # p, g, the clipping factor (none), m, v
        kernel(*args)  # compile, and the result to compare
        outputs.append(bufs[0].copy())
        t0 = time.perf_counter()
        for _ in range(a.repeat):
            kernel(*args)
        times.append((time.perf_counter() - t0) / a.repeat)
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-6)
    for (name, _), t in zip(variants, times):
        print(f"adam {name:32s} {a.n:,} params  {t * 1e3:7.2f} ms  {a.n * 16 / t / 1e9:6.1f} GB/s touched")


if __name__ == "__main__":
    main()
