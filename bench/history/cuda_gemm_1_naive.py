"""GEMM variant 1: one thread per output element, reading A and B straight from global memory.

    python bench/history/cuda_gemm_1_naive.py                    # 1024², 2048², 4096² on the GPU
    python bench/history/cuda_gemm_1_naive.py --sizes 512 1024
    NUMBA_ENABLE_CUDASIM=1 python bench/history/cuda_gemm_1_naive.py   # correctness only, tiny shapes

C[M,N] = A[M,K]·B[N,K]ᵀ, the Linear forward layout. Every block shape is checked
against numpy on an odd-sized problem before anything is timed. The baseline for
the variants that follow: each thread streams a row of A and a row of B, so every
operand element is read from DRAM/L2 M or N times and the B reads of a warp are
K floats apart (uncoalesced).
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import check, gemm_tolerance, gflops, gpu_mode, random_operands, time_kernel  # noqa: E402

from numba import cuda, float32  # noqa: E402

BLOCKS = [(16, 16), (32, 8), (8, 32), (32, 32)]
SIM_BLOCKS = [(4, 4), (8, 2)]


@cuda.jit
def gemm_naive(a, b, c, M, N, K):
    """c[m, n] = Σ_k a[m, k]·b[n, k]; threads x over n, y over m."""
    n, m = cuda.grid(2)
    if m < M and n < N:
        acc = float32(0.0)
        for k in range(K):
            acc += a[m, k] * b[n, k]
        c[m, n] = acc


def run(a_d, b_d, c_d, M, N, K, block):
    grid = ((N + block[0] - 1) // block[0], (M + block[1] - 1) // block[1])
    gemm_naive[grid, block](a_d, b_d, c_d, M, N, K)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--repeat", type=int, default=5, help="timed rounds of 10 calls each")
    args = p.parse_args()
    mode = gpu_mode("cuda_gemm_1_naive")
    blocks = SIM_BLOCKS if mode == "sim" else BLOCKS
    M, K, N = (13, 11, 9) if mode == "sim" else (333, 257, 129)
    a, b, want = random_operands(M, K, N)
    a_d, b_d = cuda.to_device(a), cuda.to_device(b)
    for block in blocks:
        c_d = cuda.device_array((M, N), np.float32)
        run(a_d, b_d, c_d, M, N, K, block)
        check(f"naive block {block} at {M}x{K}x{N}", c_d.copy_to_host(), want, **gemm_tolerance(K))
    print(f"correct at {M}x{K}x{N} for blocks {blocks}")
    if mode == "sim":
        return
    for size in args.sizes:
        a, b, want = random_operands(size, size, size)
        a_d, b_d, c_d = cuda.to_device(a), cuda.to_device(b), cuda.device_array((size, size), np.float32)
        for block in blocks:
            run(a_d, b_d, c_d, size, size, size, block)
            check(f"naive block {block} at {size}³", c_d.copy_to_host(), want, **gemm_tolerance(size))
            t = time_kernel(lambda: run(a_d, b_d, c_d, size, size, size, block), repeat=args.repeat)
            print(f"naive  M=N=K={size:5d}  block {str(block):9s} {t * 1e3:9.3f} ms  "
                  f"{gflops(size, size, size, t):9.1f} GFLOP/s")


if __name__ == "__main__":
    main()
