"""GEMM variant 2: shared-memory tiles, one output element per thread.

    python bench/history/cuda_gemm_2_tiled.py                    # 1024², 2048², 4096² on the GPU
    NUMBA_ENABLE_CUDASIM=1 python bench/history/cuda_gemm_2_tiled.py   # correctness only, tiny shapes

C[M,N] = A[M,K]·B[N,K]ᵀ. A T×T block stages a T×T tile of A and of B in shared
memory per K step (coalesced loads along K), so each global element is read M/T
or N/T times instead of M or N times. Each thread still does one FMA per two
shared-memory loads, which caps it well below peak: variant 3 fixes that with
register blocking. The B tile is read down a column, so it gets a pad column
against bank conflicts. Every tile size is checked before it is timed.
"""

import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import check, gemm_tolerance, gflops, gpu_mode, random_operands, time_kernel  # noqa: E402

from numba import cuda, float32  # noqa: E402

TILES = [8, 16, 32]
SIM_TILES = [2, 4]


@functools.lru_cache(maxsize=None)
def make_kernel(T):
    TP = T + 1  # shared-array shapes must be constants

    @cuda.jit
    def gemm_tiled(a, b, c, M, N, K):
        a_tile = cuda.shared.array((T, T), float32)
        b_tile = cuda.shared.array((T, TP), float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = cuda.blockIdx.y * T + ty
        n = cuda.blockIdx.x * T + tx
        n_load = cuda.blockIdx.x * T + ty  # the B row this thread loads
        acc = float32(0.0)
        for k0 in range(0, K, T):
            k = k0 + tx
            a_tile[ty, tx] = a[m, k] if m < M and k < K else float32(0.0)
            b_tile[ty, tx] = b[n_load, k] if n_load < N and k < K else float32(0.0)
            cuda.syncthreads()
            for kk in range(T):
                acc += a_tile[ty, kk] * b_tile[tx, kk]
            cuda.syncthreads()
        if m < M and n < N:
            c[m, n] = acc

    return gemm_tiled


def run(a_d, b_d, c_d, M, N, K, T):
    grid = ((N + T - 1) // T, (M + T - 1) // T)
    make_kernel(T)[grid, (T, T)](a_d, b_d, c_d, M, N, K)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--repeat", type=int, default=5, help="timed rounds of 10 calls each")
    args = p.parse_args()
    mode = gpu_mode("cuda_gemm_2_tiled")
    tiles = SIM_TILES if mode == "sim" else TILES
    M, K, N = (13, 11, 9) if mode == "sim" else (333, 257, 129)
    a, b, want = random_operands(M, K, N)
    a_d, b_d = cuda.to_device(a), cuda.to_device(b)
    for T in tiles:
        c_d = cuda.device_array((M, N), np.float32)
        run(a_d, b_d, c_d, M, N, K, T)
        check(f"tiled T={T} at {M}x{K}x{N}", c_d.copy_to_host(), want, **gemm_tolerance(K))
    print(f"correct at {M}x{K}x{N} for tiles {tiles}")
    if mode == "sim":
        return
    for size in args.sizes:
        a, b, want = random_operands(size, size, size)
        a_d, b_d, c_d = cuda.to_device(a), cuda.to_device(b), cuda.device_array((size, size), np.float32)
        for T in tiles:
            run(a_d, b_d, c_d, size, size, size, T)
            check(f"tiled T={T} at {size}³", c_d.copy_to_host(), want, **gemm_tolerance(size))
            t = time_kernel(lambda: run(a_d, b_d, c_d, size, size, size, T), repeat=args.repeat)
            print(f"tiled  M=N=K={size:5d}  T={T:3d}  {t * 1e3:9.3f} ms  {gflops(size, size, size, t):9.1f} GFLOP/s")


if __name__ == "__main__":
    main()
