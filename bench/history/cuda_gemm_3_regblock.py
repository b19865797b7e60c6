"""GEMM variant 3: shared-memory tiles plus register blocking (hpctrain's kernel until variant 4).

    python bench/history/cuda_gemm_3_regblock.py                 # every tiling below at 1024², 2048², 4096²
    python bench/history/cuda_gemm_3_regblock.py --tiles 128,128,8,8,8 64,64,8,4,4
    NUMBA_ENABLE_CUDASIM=1 python bench/history/cuda_gemm_3_regblock.py   # correctness only, tiny tilings

The kernel (kept here as it was in hpctrain/backend/cuda/gemm/tiled.py): a BM×BN block tile walks K in BK
steps through shared memory, and each thread accumulates a TM×TN sub-tile in
registers, so one pair of shared loads feeds TM·TN/(TM+TN) FMAs instead of ½.
Tilings are written BM,BN,BK,TM,TN. Each is checked in all three layouts (X·Wᵀ,
dY·W, dYᵀ·X) on an odd-sized problem before the X·Wᵀ layout is timed; the best
one was the library default (``GPU_TILE``). Compiled for sm_90 (bench/cuda_sass_report.py's
method) it needs 128-160 registers and a 256-byte stack at the default tiling, and multiply-adds
are 40% of its K loop: numba checks every signed shared-memory index for wraparound. Variant 4
(bench/history/cuda_gemm_4_pipelined.py, the library kernel now) fixes that. bench/bench_cuda_gemm.py
compares the library against cuBLAS.
"""

import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import check, gemm_tolerance, gflops, gpu_mode, random_operands, time_kernel  # noqa: E402

from numba import cuda  # noqa: E402

from numba import float32, uint64  # noqa: E402

from hpctrain.backend.cuda import sim as cuda_sim  # noqa: E402
from hpctrain.backend.cuda.gemm.tiled import (EPI_ACCUMULATE, EPI_BIAS, EPI_STORE, GPU_TILE, GemmTile,  # noqa: E402
                                        _bank_pad, launch_config)

TILES = [GemmTile(64, 64, 8, 4, 4), GemmTile(64, 64, 16, 4, 4), GemmTile(128, 64, 8, 8, 4),
         GemmTile(64, 128, 8, 4, 8), GemmTile(128, 128, 8, 8, 8), GemmTile(128, 128, 16, 8, 8)]
SIM_TILES = [GemmTile(8, 8, 4, 2, 2), GemmTile(6, 4, 5, 3, 2)]


@functools.lru_cache(maxsize=None)
def _no_bias():
    return cuda.to_device(np.zeros(1, np.float32))  # the kernel always takes a bias array


@functools.lru_cache(maxsize=None)
def regblock_kernels(tile: GemmTile):
    """Variant 3's (nt, nn, tn) kernels for one tiling."""
    tile.check()
    cuda_sim.install()
    return (_make_regblock(tile, a_kmajor=True, b_kmajor=True), _make_regblock(tile, a_kmajor=True, b_kmajor=False),
            _make_regblock(tile, a_kmajor=False, b_kmajor=False))


def _make_regblock(tile: GemmTile, *, a_kmajor: bool, b_kmajor: bool):
    BM, BN, BK, TM, TN = tile
    NTX, NTY = tile.threads
    NT = NTX * NTY
    # A k-major operand is stored transposed into shared memory (k rows, m columns), with pad
    # columns that spread those strided stores over the 32 banks. Shapes must be plain constants.
    AW = BM + (_bank_pad(BM, BK) if a_kmajor else 0)
    BW = BN + (_bank_pad(BN, BK) if b_kmajor else 0)
    A_ELEMS, B_ELEMS = BM * BK, BN * BK
    A_LOADS = (A_ELEMS + NT - 1) // NT
    B_LOADS = (B_ELEMS + NT - 1) // NT
    A_EVEN, B_EVEN = A_ELEMS % NT == 0, B_ELEMS % NT == 0  # every thread loads the same count: no check

    @cuda.jit
    def gemm(a, b, c, bias, M, N, K, epilogue):
        """c[M,N] = a·b with the operand layouts fixed above; epilogue: store, accumulate or add bias[N]."""
        a_tile = cuda.shared.array((BK, AW), float32)
        b_tile = cuda.shared.array((BK, BW), float32)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * NTX + tx
        m0 = cuda.blockIdx.y * BM
        n0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        for k0 in range(0, K, BK):
            for load in range(A_LOADS):
                e = tid + load * NT
                if A_EVEN or e < A_ELEMS:
                    if a_kmajor:  # a[M,K]: neighbouring threads take neighbouring k
                        kk = e % BK
                        mm = e // BK
                    else:  # a[K,M]: neighbouring threads take neighbouring m
                        mm = e % BM
                        kk = e // BM
                    gm = m0 + mm
                    gk = k0 + kk
                    v = float32(0.0)
                    if gm < M and gk < K:  # unsigned indices: numba skips its negative-index wraparound
                        if a_kmajor:
                            v = a[uint64(gm), uint64(gk)]
                        else:
                            v = a[uint64(gk), uint64(gm)]
                    a_tile[kk, mm] = v
            for load in range(B_LOADS):
                e = tid + load * NT
                if B_EVEN or e < B_ELEMS:
                    if b_kmajor:  # b[N,K]
                        kk = e % BK
                        nn = e // BK
                    else:  # b[K,N]
                        nn = e % BN
                        kk = e // BN
                    gn = n0 + nn
                    gk = k0 + kk
                    v = float32(0.0)
                    if gn < N and gk < K:
                        if b_kmajor:
                            v = b[uint64(gn), uint64(gk)]
                        else:
                            v = b[uint64(gk), uint64(gn)]
                    b_tile[kk, nn] = v
            cuda.syncthreads()
            for kk in range(BK):
                for i in range(TM):
                    a_frag[i] = a_tile[kk, ty + i * NTY]
                for j in range(TN):
                    b_frag[j] = b_tile[kk, tx + j * NTX]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_frag[i] * b_frag[j]
            cuda.syncthreads()  # the tiles are overwritten by the next K step
        for i in range(TM):
            gm = m0 + ty + i * NTY
            if gm < M:
                for j in range(TN):
                    gn = n0 + tx + j * NTX
                    if gn < N:
                        v = acc[i, j]
                        if epilogue == EPI_ACCUMULATE:
                            v += c[gm, gn]
                        elif epilogue == EPI_BIAS:
                            v += bias[gn]
                        c[gm, gn] = v

    return gemm


def run(kernels, tile, layout, a_d, b_d, c_d, M, N, K):
    kernel = dict(zip(("nt", "nn", "tn"), kernels(tile)))[layout]
    grid, threads = launch_config(tile, M, N)
    kernel[grid, threads](a_d, b_d, c_d, _no_bias(), M, N, K, EPI_STORE)


def check_tile(kernels, tile, M, K, N):
    a, b, want = random_operands(M, K, N)
    cases = {  # layout: (A operand, B operand, expected, (rows, cols) of C)
        "nt": (a, b, want, (M, N)),
        "nn": (a, np.ascontiguousarray(b.T), want, (M, N)),
        "tn": (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T), want, (M, N)),
    }
    for layout, (x, y, expected, shape) in cases.items():
        c_d = cuda.device_array(shape, np.float32)
        run(kernels, tile, layout, cuda.to_device(x), cuda.to_device(y), c_d, shape[0], shape[1], K)
        check(f"tile {tuple(tile)} {layout} at {M}x{K}x{N}", c_d.copy_to_host(), expected, **gemm_tolerance(K))


def main(kernels=regblock_kernels, name="cuda_gemm_3_regblock", label="regblock", doc=__doc__):
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--tiles", nargs="+", default=None, help="BM,BN,BK,TM,TN ...")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds of 10 calls each")
    args = p.parse_args()
    mode = gpu_mode(name)
    if args.tiles:
        tiles = [GemmTile(*map(int, t.split(","))).check() for t in args.tiles]
    else:
        tiles = SIM_TILES if mode == "sim" else TILES
    M, K, N = (13, 11, 9) if mode == "sim" else (333, 257, 129)
    for tile in tiles:
        check_tile(kernels, tile, M, K, N)
    print(f"correct at {M}x{K}x{N} in all three layouts for tilings {[tuple(t) for t in tiles]}")
    if mode == "sim":
        return
    print(f"library default GPU_TILE = {tuple(GPU_TILE)}")
    for size in args.sizes:
        a, b, want = random_operands(size, size, size)
        a_d, b_d, c_d = cuda.to_device(a), cuda.to_device(b), cuda.device_array((size, size), np.float32)
        for tile in tiles:
            run(kernels, tile, "nt", a_d, b_d, c_d, size, size, size)
            check(f"tile {tuple(tile)} at {size}³", c_d.copy_to_host(), want, **gemm_tolerance(size))
            t = time_kernel(lambda: run(kernels, tile, "nt", a_d, b_d, c_d, size, size, size), repeat=args.repeat)
            print(f"{label} M=N=K={size:5d}  tile {','.join(map(str, tile)):16s} {t * 1e3:9.3f} ms  "
                  f"{gflops(size, size, size, t):9.1f} GFLOP/s")


if __name__ == "__main__":
    main()
