"""GEMM variant 3: shared-memory tiles plus register blocking (the kernel hpctrain uses).

    python bench/cuda_gemm_3_regblock.py                 # every tiling below at 1024², 2048², 4096²
    python bench/cuda_gemm_3_regblock.py --tiles 128,128,8,8,8 64,64,8,4,4
    NUMBA_ENABLE_CUDASIM=1 python bench/cuda_gemm_3_regblock.py   # correctness only, tiny tilings

The kernel is hpctrain/backend/cuda_gemm.py's: a BM×BN block tile walks K in BK
steps through shared memory, and each thread accumulates a TM×TN sub-tile in
registers, so one pair of shared loads feeds TM·TN/(TM+TN) FMAs instead of ½.
Tilings are written BM,BN,BK,TM,TN. Each is checked in all three layouts (X·Wᵀ,
dY·W, dYᵀ·X) on an odd-sized problem before the X·Wᵀ layout is timed; the best
one is the library default (``GPU_TILE``). bench/bench_cuda_gemm.py compares the
library against cuBLAS.
"""

import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import check, gemm_tolerance, gflops, gpu_mode, random_operands, time_kernel  # noqa: E402

from numba import cuda  # noqa: E402

from hpctrain.backend.cuda_gemm import (EPI_STORE, GPU_TILE, GemmTile, gemm_kernels,  # noqa: E402
                                        launch_config)

TILES = [GemmTile(64, 64, 8, 4, 4), GemmTile(64, 64, 16, 4, 4), GemmTile(128, 64, 8, 8, 4),
         GemmTile(64, 128, 8, 4, 8), GemmTile(128, 128, 8, 8, 8), GemmTile(128, 128, 16, 8, 8)]
SIM_TILES = [GemmTile(8, 8, 4, 2, 2), GemmTile(6, 4, 5, 3, 2)]


@functools.lru_cache(maxsize=None)
def _no_bias():
    return cuda.to_device(np.zeros(1, np.float32))  # the kernel always takes a bias array


def run(tile, layout, a_d, b_d, c_d, M, N, K):
    kernel = dict(zip(("nt", "nn", "tn"), gemm_kernels(tile)))[layout]
    grid, threads = launch_config(tile, M, N)
    kernel[grid, threads](a_d, b_d, c_d, _no_bias(), M, N, K, EPI_STORE)


def check_tile(tile, M, K, N):
    a, b, want = random_operands(M, K, N)
    cases = {  # layout: (A operand, B operand, expected, (rows, cols) of C)
        "nt": (a, b, want, (M, N)),
        "nn": (a, np.ascontiguousarray(b.T), want, (M, N)),
        "tn": (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T), want, (M, N)),
    }
    for layout, (x, y, expected, shape) in cases.items():
        c_d = cuda.device_array(shape, np.float32)
        run(tile, layout, cuda.to_device(x), cuda.to_device(y), c_d, shape[0], shape[1], K)
        check(f"tile {tuple(tile)} {layout} at {M}x{K}x{N}", c_d.copy_to_host(), expected, **gemm_tolerance(K))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--tiles", nargs="+", default=None, help="BM,BN,BK,TM,TN ...")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds of 10 calls each")
    args = p.parse_args()
    mode = gpu_mode("cuda_gemm_3_regblock")
    if args.tiles:
        tiles = [GemmTile(*map(int, t.split(","))).check() for t in args.tiles]
    else:
        tiles = SIM_TILES if mode == "sim" else TILES
    M, K, N = (13, 11, 9) if mode == "sim" else (333, 257, 129)
    for tile in tiles:
        check_tile(tile, M, K, N)
    print(f"correct at {M}x{K}x{N} in all three layouts for tilings {[tuple(t) for t in tiles]}")
    if mode == "sim":
        return
    print(f"library default GPU_TILE = {tuple(GPU_TILE)}")
    for size in args.sizes:
        a, b, want = random_operands(size, size, size)
        a_d, b_d, c_d = cuda.to_device(a), cuda.to_device(b), cuda.device_array((size, size), np.float32)
        for tile in tiles:
            run(tile, "nt", a_d, b_d, c_d, size, size, size)
            check(f"tile {tuple(tile)} at {size}³", c_d.copy_to_host(), want, **gemm_tolerance(size))
            t = time_kernel(lambda: run(tile, "nt", a_d, b_d, c_d, size, size, size), repeat=args.repeat)
            print(f"regblock M=N=K={size:5d}  tile {','.join(map(str, tile)):16s} {t * 1e3:9.3f} ms  "
                  f"{gflops(size, size, size, t):9.1f} GFLOP/s")


if __name__ == "__main__":
    main()
