"""The CUDA GEMM: a shared-memory tiled, register-blocked kernel in three operand layouts.

    C[M,N] = A·B with A either [M,K] ("k-major", K contiguous) or [K,M], and B either
    [N,K] (k-major) or [K,N]:

    matmul_nt  out = X·Wᵀ (+ bias)   A = X [M,K] k-major,  B = W [N,K] k-major   (Linear forward)
    matmul_nn  out = dY·W            A = dY [M,K] k-major, B = W [K,N]           (input gradient)
    matmul_tn  out (+)= dYᵀ·X        A = dY [K,M],         B = X [K,N]           (weight gradient)

A thread block owns a BM×BN tile of C and walks K in steps of BK. Each step the
block loads a BK×BM slice of A and a BK×BN slice of B into shared memory (global
reads are coalesced: consecutive threads read consecutive addresses of whichever
axis is contiguous), then every thread multiplies TM values of A by TN values of B
held in registers into its TM×TN accumulators. A thread's outputs are strided by
the thread-grid size (rows ty, ty+BM/TM, ...; columns tx, tx+BN/TN, ...) so that a
warp reads consecutive shared-memory words (no bank conflicts) and writes
consecutive columns of C (coalesced stores). Tiles that hang over the edge of the
matrices are zero-filled on load and masked on store, so any M, N, K works.

Tile sizes are compile-time constants of a kernel built per ``GemmTile`` (shared
and local array shapes must be constants), so a backend picks them at construction:
128×128×8 with 8×8 register blocks on a GPU, tiny ones under the simulator.
Experiments with other tilings live in bench/cuda_gemm_*.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from numba import cuda, float32, uint64

from ..errors import BackendError
from . import cuda_sim

__all__ = ["GemmTile", "GPU_TILE", "SIM_TILE", "gemm_kernels", "launch_config", "EPI_STORE", "EPI_ACCUMULATE",
           "EPI_BIAS"]

# epilogues: what the kernel does with its accumulators
EPI_STORE, EPI_ACCUMULATE, EPI_BIAS = 0, 1, 2


class GemmTile(NamedTuple):
    """BM×BN outputs per block, BK deep K slices, TM×TN outputs per thread ((BM/TM)·(BN/TN) threads)."""

    BM: int
    BN: int
    BK: int
    TM: int
    TN: int

    @property
    def threads(self) -> tuple[int, int]:
        """The block shape (x over columns, y over rows)."""
        return self.BN // self.TN, self.BM // self.TM

    def check(self) -> "GemmTile":
        if min(self) < 1:
            raise BackendError(f"GEMM tile {tuple(self)}: every size must be >= 1")
        if self.BM % self.TM or self.BN % self.TN:
            raise BackendError(f"GEMM tile {tuple(self)}: BM must be a multiple of TM and BN of TN")
        nx, ny = self.threads
        if nx * ny > 1024:
            raise BackendError(f"GEMM tile {tuple(self)}: {nx * ny} threads per block, at most 1024")
        return self


GPU_TILE = GemmTile(128, 128, 8, 8, 8)  # 256 threads, 64 accumulators each, 8.3 KiB of shared memory
SIM_TILE = GemmTile(8, 8, 4, 2, 2)  # 16 threads: the simulator runs every thread as a Python thread


def launch_config(tile: GemmTile, M: int, N: int):
    """(grid, block) for an M×N output: blocks over (column tiles, row tiles)."""
    return ((N + tile.BN - 1) // tile.BN, (M + tile.BM - 1) // tile.BM), tile.threads


@functools.lru_cache(maxsize=None)
def gemm_kernels(tile: GemmTile):
    """The (nt, nn, tn) kernels for one tiling; compiled lazily on first launch, once per process."""
    tile.check()
    cuda_sim.install()  # under the simulator: shared arrays that every thread of a block agrees on
    return (_make_gemm(tile, a_kmajor=True, b_kmajor=True),
            _make_gemm(tile, a_kmajor=True, b_kmajor=False),
            _make_gemm(tile, a_kmajor=False, b_kmajor=False))


def _bank_pad(width: int, BK: int) -> int:
    """Pad so that a warp storing a transposed tile (thread t -> row t % BK, column t // BK) hits 32 banks.

    Word (t % BK)·W + t // BK falls in bank ((t % BK)·(W mod 32) + t // BK) mod 32: with
    W ≡ 32 / BK (mod 32) those are all different.
    """
    if 32 % BK:
        return 1
    return (32 // BK - width) % 32


def _make_gemm(tile: GemmTile, *, a_kmajor: bool, b_kmajor: bool):
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
