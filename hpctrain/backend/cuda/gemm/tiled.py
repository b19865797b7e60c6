"""The CUDA GEMM: a shared-memory tiled, register-blocked kernel in three operand layouts.

    C[M,N] = A·B with A either [M,K] ("k-major", K contiguous) or [K,M], and B either
    [N,K] (k-major) or [K,N]:

    matmul_nt  out = X·Wᵀ (+ bias)   A = X [M,K] k-major,  B = W [N,K] k-major   (Linear forward)
    matmul_nn  out = dY·W            A = dY [M,K] k-major, B = W [K,N]           (input gradient)
    matmul_tn  out (+)= dYᵀ·X        A = dY [K,M],         B = X [K,N]           (weight gradient)

A thread block owns a BM×BN tile of C and walks K in steps of BK. Each step the
block multiplies a BK×BM slice of A by a BK×BN slice of B held in shared memory:
every thread reads TM values of A and TN values of B into registers and adds their
products into its TM×TN accumulators. Global reads are coalesced (consecutive
threads read consecutive addresses of whichever axis is contiguous); a thread's
rows and columns are contiguous and the tile rows 16-byte aligned, so its shared
reads are 128-bit loads. Two shared-memory stages pipeline the K walk: the global
loads of the next slice go into registers before this slice is multiplied and
into the other stage after it, with one barrier per slice. All index arithmetic
is uint64: numba checks every signed index for wraparound, which had cost a
compare and a select per shared load. Tiles that hang over the edge of the
matrices are zero-filled on load and masked on store, so any M, N, K works.
bench/cuda_sass_report.py shows what this compiles to (registers, occupancy, the
share of multiply-adds in the K loop); tests/test_cuda_compile.py holds it there.

Tile sizes are compile-time constants of a kernel built per ``GemmTile`` (shared
and local array shapes must be constants). On a GPU the backend keeps three tilings,
128×128×8 with 8×8 register blocks, 64×64×8 with 8×4 and 32×32×8 with 4×4, and takes
the largest whose grid fills the GPU (``choose_tile``); weight gradients choose between
the first two and are split along K where still under a wave (``k_splits``); tiny ones under the
simulator. Experiments with other tilings live in bench/cuda_gemm_*.py.

The **batched** kernels (``batched_gemm_kernels``) are the same kernel source with a
third grid axis z: each z multiplies sub-matrices of three 2-D arrays at offsets

    rows  zb·rb + zh·rh,   columns  c0 + zh·ch,    zb = z // H, zh = z % H

given per operand as ``(rb, rh, c0, ch)``. With z over (batch, head) that is every
head's q·kᵀ, att·v and their gradients, read in place from the fused qkv[B·T, 3C]
and att[B·H·T, T] (``mode`` skips what a causal mask makes zero: whole tiles above
the diagonal, or the part of K that multiplies zeros). With z over slices of K it is
a split-K product: each z writes its partial product to a workspace and
``sum_splits`` adds them in z order, so the result does not depend on timing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, uint64

from ....errors import BackendError
from .. import sim

__all__ = ["GemmTile", "GPU_TILE", "GPU_SMALL_TILE", "GPU_TINY_TILE", "GPU_TILES", "GPU_TN_TILES", "SIM_TILE", "gemm_kernels", "batched_gemm_kernels",
           "launch_config", "EPI_STORE", "EPI_ACCUMULATE", "EPI_BIAS", "MODE_PLAIN", "MODE_CAUSAL_UPPER",
           "MODE_CAUSAL_K_BELOW", "MODE_CAUSAL_K_FROM", "MODE_SPLIT_K", "MAX_GRID_Z", "grid_blocks", "choose_tile",
           "k_splits"]

# epilogues: what the kernel does with its accumulators
EPI_STORE, EPI_ACCUMULATE, EPI_BIAS = 0, 1, 2

# batched kernels' modes: which part of each z's product is computed
MODE_PLAIN = 0  # all of it
MODE_CAUSAL_UPPER = 1  # an M×M product whose entries above the diagonal are not needed: those tiles are skipped
MODE_CAUSAL_K_BELOW = 2  # row i only needs k ≤ i (the A operand is zero above its diagonal)
MODE_CAUSAL_K_FROM = 3  # row j only needs k ≥ j (the transposed A operand is zero below its diagonal)
MODE_SPLIT_K = 4  # z multiplies K-slice z of length K (the last one shorter: k_total − z·K)
MAX_GRID_Z = 65535  # CUDA's limit on gridDim.z: longer batches are launched in chunks (argument z0)


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

    def check(self, aligned: bool = False) -> "GemmTile":
        """Raise BackendError unless the tiling can be built; ``aligned`` (a GPU's tilings): also unless a thread's
        fragments are 128-bit shared loads, i.e. TM and TN multiples of 4 and every shared row (bank padding
        included) a multiple of 16 bytes. The simulator's tilings need not be."""
        if min(self) < 1:
            raise BackendError(f"GEMM tile {tuple(self)}: every size must be >= 1")
        if self.BM % self.TM or self.BN % self.TN:
            raise BackendError(f"GEMM tile {tuple(self)}: BM must be a multiple of TM and BN of TN")
        nx, ny = self.threads
        if nx * ny > 1024:
            raise BackendError(f"GEMM tile {tuple(self)}: {nx * ny} threads per block, at most 1024")
        if self.shared_bytes > MAX_STATIC_SHARED:
            raise BackendError(f"GEMM tile {tuple(self)}: {self.shared_bytes} bytes of shared memory for its two "
                               f"stages, at most {MAX_STATIC_SHARED} (lower BK, BM or BN)")
        if aligned:
            rows = (self.BM + _bank_pad(self.BM, self.BK), self.BN + _bank_pad(self.BN, self.BK), self.BM, self.BN)
            if self.TM % 4 or self.TN % 4 or any(r % 4 for r in rows):
                raise BackendError(f"GEMM tile {tuple(self)}: TM and TN must be multiples of 4 and the shared rows "
                                   f"({', '.join(map(str, rows))} floats) multiples of 4, so that a thread reads its "
                                   "fragments with 16-byte loads")
        return self

    @property
    def shared_bytes(self) -> int:
        """Static shared memory of the kernel: two stages of a BK×BM and a BK×BN slice, bank padding included
        (the largest of the three layouts)."""
        pad_a, pad_b = _bank_pad(self.BM, self.BK), _bank_pad(self.BN, self.BK)
        return 2 * self.BK * (self.BM + pad_a + self.BN + pad_b) * 4


MAX_STATIC_SHARED = 48 * 1024  # what a kernel may declare statically on every GPU since sm_50


GPU_TILE = GemmTile(128, 128, 8, 8, 8)  # 256 threads, 64 accumulators each, 16.5 KiB of shared memory (2 stages)
GPU_SMALL_TILE = GemmTile(64, 64, 8, 8, 4)  # 128 threads, 32 accumulators each: 4x the blocks of GPU_TILE
GPU_TINY_TILE = GemmTile(32, 32, 8, 4, 4)  # 64 threads, 16 each: 4x the blocks again (narrow X·Wᵀ and dY·W)
GPU_TILES = (GPU_TILE, GPU_SMALL_TILE, GPU_TINY_TILE)  # what a GPU chooses from for X·Wᵀ and dY·W, largest first
GPU_TN_TILES = GPU_TILES[:2]  # and for dYᵀ·X, which is split along K instead where still under a wave
SIM_TILE = GemmTile(8, 8, 4, 2, 2)  # 16 threads: the simulator runs every thread as a Python thread


def launch_config(tile: GemmTile, M: int, N: int, Z: int = 0):
    """(grid, block) for an M×N output: blocks over (column tiles, row tiles[, Z batch entries])."""
    grid = ((N + tile.BN - 1) // tile.BN, (M + tile.BM - 1) // tile.BM)
    return (grid + (Z,) if Z else grid), tile.threads


def grid_blocks(tile: GemmTile, M: int, N: int) -> int:
    """Blocks in the grid of an M×N product."""
    return -(-M // tile.BM) * -(-N // tile.BN)


def choose_tile(tiles, wave: int, M: int, N: int) -> GemmTile:
    """The first (largest) of ``tiles`` whose grid for M×N makes at least one wave (``wave`` blocks: one per SM),
    else the last (smallest)."""
    for tile in tiles:
        if grid_blocks(tile, M, N) >= wave:
            return tile
    return tiles[-1]


SPLIT_K_MIN_SLICES = 4  # a split-K slice is at least 4 BK-deep slices long (32 on a GPU)


def k_splits(tile: GemmTile, wave: int, M: int, N: int, K: int) -> int:
    """How many K slices a product whose grid is under one wave is split into: enough for about two waves,
    each slice at least SPLIT_K_MIN_SLICES·BK long; 1 for no split."""
    blocks = grid_blocks(tile, M, N)
    if blocks >= wave:
        return 1
    splits = max(1, min(-(-2 * wave // blocks), K // (SPLIT_K_MIN_SLICES * tile.BK)))
    return -(-K // -(-K // splits))  # no empty last slice


@functools.lru_cache(maxsize=None)
def gemm_kernels(tile: GemmTile):
    """The (nt, nn, tn) kernels for one tiling; compiled lazily on first launch, once per process."""
    tile.check()
    sim.install()  # under the simulator: shared arrays that every thread of a block agrees on
    return (_make_gemm(tile, a_kmajor=True, b_kmajor=True),
            _make_gemm(tile, a_kmajor=True, b_kmajor=False),
            _make_gemm(tile, a_kmajor=False, b_kmajor=False))


@functools.lru_cache(maxsize=None)
def batched_gemm_kernels(tile: GemmTile):
    """The batched (nt, nn, tn) kernels for one tiling and ``sum_splits``, the split-K second stage."""
    tile.check()
    sim.install()
    return (_make_gemm(tile, a_kmajor=True, b_kmajor=True, batched=True),
            _make_gemm(tile, a_kmajor=True, b_kmajor=False, batched=True),
            _make_gemm(tile, a_kmajor=False, b_kmajor=False, batched=True),
            _sum_splits)


@cuda.jit
def _sum_splits(ws, out, S, accumulate):
    """out (+)= Σ_z ws[z·n : (z+1)·n] over z = 0..S-1 in that order (n = out.size): split-K's second stage."""
    n = out.size
    for e in range(cuda.grid(1), n, cuda.gridsize(1)):
        acc = ws[e]
        for z in range(1, S):
            acc += ws[z * n + e]
        if accumulate:
            acc = out[e] + acc
        out[e] = acc


def _bank_pad(width: int, BK: int) -> int:
    """Pad so that a warp storing a transposed tile (thread t -> row t % BK, column t // BK) hits 32 banks.

    Word (t % BK)·W + t // BK falls in bank ((t % BK)·(W mod 32) + t // BK) mod 32: with
    W ≡ 32 / BK (mod 32) those are all different.
    """
    if 32 % BK:
        return 1
    return (32 // BK - width) % 32


def _operand_io(width: int, BK: int, NT: int, kmajor: bool):
    """(load, store) device functions for one operand's BK×width slice, shared by NT threads.

    ``load(src, regs, tid, r0, k0, rows, uk, ro, co)`` reads this thread's share of the slice at k0 (rows r0 ..
    r0 + width of the operand, zero past the edges) from global memory into ``regs``; the operand sits at
    row ``ro``, column ``co`` of ``src`` (0, 0 but in the batched kernels); ``store(tile, stage, regs,
    tid)`` writes it into shared stage ``stage``, k rows by ``width`` columns. ``src`` is [rows, K]
    (``kmajor``: neighbouring threads take neighbouring k) or [K, rows] (neighbouring rows)."""
    U = np.uint64
    ELEMS = width * BK
    LOADS = (ELEMS + NT - 1) // NT
    EVEN = ELEMS % NT == 0  # every thread loads the same count: no check
    uW, uBK, uNT, uELEMS = U(width), U(BK), U(NT), U(ELEMS)

    @sim.inlined_device_jit()
    def load(src, regs, tid, r0, k0, rows, uk, ro, co):
        e = tid
        for slot in range(LOADS):
            v = float32(0.0)
            if EVEN or e < uELEMS:
                if kmajor:
                    r, k = r0 + e // uBK, k0 + e % uBK
                else:
                    r, k = r0 + e % uW, k0 + e // uW
                if r < rows and k < uk:
                    v = src[ro + r, co + k] if kmajor else src[ro + k, co + r]
            regs[slot] = v
            e += uNT

    @sim.inlined_device_jit()
    def store(tile, stage, regs, tid):
        e = tid
        for slot in range(LOADS):
            if EVEN or e < uELEMS:
                if kmajor:
                    tile[stage, e % uBK, e // uBK] = regs[slot]
                else:
                    tile[stage, e // uW, e % uW] = regs[slot]
            e += uNT

    return load, store, LOADS


def _make_gemm(tile: GemmTile, *, a_kmajor: bool, b_kmajor: bool, batched: bool = False):
    BM, BN, BK, TM, TN = tile
    NTX, NTY = tile.threads
    NT = NTX * NTY
    # A k-major operand is stored transposed into shared memory (k rows, m columns), with pad
    # columns that spread those strided stores over the 32 banks. Shapes must be plain constants.
    AW = BM + (_bank_pad(BM, BK) if a_kmajor else 0)
    BW = BN + (_bank_pad(BN, BK) if b_kmajor else 0)
    load_a, store_a, A_LOADS = _operand_io(BM, BK, NT, a_kmajor)
    load_b, store_b, B_LOADS = _operand_io(BN, BK, NT, b_kmajor)
    # Index arithmetic is unsigned 64-bit throughout: numba checks every signed index for wraparound
    # (a compare and a select per shared-memory load), and uint64 mixed with a signed int is float64.
    U = np.uint64
    uBM, uBN, uBK, uNTX, uTM, uTN = U(BM), U(BN), U(BK), U(NTX), U(TM), U(TN)
    ZERO, ONE = U(0), U(1)

    @sim.inlined_device_jit()
    def tile_product(a, b, c, bias, um, un, uk, k0, epilogue, ar, ac, br, bc, cr, cc):
        """This block's BM×BN tile of c (at row cr, column cc of the array) from k0 to uk."""
        a_tile = cuda.shared.array((2, BK, AW), float32)  # two stages: one computed from, one filled
        b_tile = cuda.shared.array((2, BK, BW), float32)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        a_regs = cuda.local.array(A_LOADS, float32)
        b_regs = cuda.local.array(B_LOADS, float32)
        tx = uint64(cuda.threadIdx.x)
        ty = uint64(cuda.threadIdx.y)
        tid = ty * uNTX + tx
        m0 = uint64(cuda.blockIdx.y) * uBM
        n0 = uint64(cuda.blockIdx.x) * uBN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        load_a(a, a_regs, tid, m0, k0, um, uk, ar, ac)
        load_b(b, b_regs, tid, n0, k0, un, uk, br, bc)
        store_a(a_tile, ZERO, a_regs, tid)
        store_b(b_tile, ZERO, b_regs, tid)
        cuda.syncthreads()
        stage = ZERO
        while k0 < uk:
            k_next = k0 + uBK
            # the next slice's global loads are in flight while this one is multiplied (past the end of K
            # they load zeros, which nobody reads)
            load_a(a, a_regs, tid, m0, k_next, um, uk, ar, ac)
            load_b(b, b_regs, tid, n0, k_next, un, uk, br, bc)
            kk = ZERO
            while kk < uBK:
                for i in range(TM):
                    a_frag[i] = a_tile[stage, kk, ty * uTM + uint64(i)]
                for j in range(TN):
                    b_frag[j] = b_tile[stage, kk, tx * uTN + uint64(j)]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_frag[i] * b_frag[j]
                kk += ONE
            store_a(a_tile, ONE - stage, a_regs, tid)  # the other stage: nobody reads it since the last barrier
            store_b(b_tile, ONE - stage, b_regs, tid)
            cuda.syncthreads()
            stage = ONE - stage
            k0 = k_next
        for i in range(TM):
            gm = m0 + ty * uTM + uint64(i)
            if gm < um:
                for j in range(TN):
                    gn = n0 + tx * uTN + uint64(j)
                    if gn < un:
                        v = acc[i, j]
                        if epilogue == EPI_ACCUMULATE:
                            v += c[cr + gm, cc + gn]
                        elif epilogue == EPI_BIAS:
                            v += bias[gn]
                        c[cr + gm, cc + gn] = v

    if not batched:
        @sim.kernel_jit(NT)
        def gemm(a, b, c, bias, M, N, K, epilogue):
            """c[M,N] = a·b with the operand layouts fixed above; epilogue: store, accumulate or add bias[N]."""
            tile_product(a, b, c, bias, uint64(M), uint64(N), uint64(K), ZERO, epilogue,
                         ZERO, ZERO, ZERO, ZERO, ZERO, ZERO)

        return gemm

    @sim.kernel_jit(NT)
    def gemm_batched(a, b, c, M, N, K, k_total, H, z0, ao, bo, co, mode):
        """For z = z0 + blockIdx.z: c_z[M,N] = a_z·b_z, each operand at its (rb, rh, c0, ch) offsets (module
        docstring); ``mode`` one of the MODE_ constants. Stores, never accumulates."""
        z = uint64(z0) + uint64(cuda.blockIdx.z)
        uh = uint64(H)
        zb = z // uh
        zh = z % uh
        m0 = uint64(cuda.blockIdx.y) * uBM
        n0 = uint64(cuda.blockIdx.x) * uBN
        um, un, uk = uint64(M), uint64(N), uint64(K)
        k0 = ZERO
        if mode == MODE_CAUSAL_UPPER:
            if n0 >= m0 + uBM:  # every entry of this tile is above the diagonal: nobody reads it
                return
        elif mode == MODE_CAUSAL_K_BELOW:
            uk = min(uk, m0 + uBM)
        elif mode == MODE_CAUSAL_K_FROM:
            k0 = m0
        elif mode == MODE_SPLIT_K:
            uk = min(uk, uint64(k_total) - zb * uk)
        tile_product(a, b, c, c[0], um, un, uk, k0, EPI_STORE,  # c[0]: a 1-D array for the unused bias
                     zb * uint64(ao[0]) + zh * uint64(ao[1]), uint64(ao[2]) + zh * uint64(ao[3]),
                     zb * uint64(bo[0]) + zh * uint64(bo[1]), uint64(bo[2]) + zh * uint64(bo[3]),
                     zb * uint64(co[0]) + zh * uint64(co[1]), uint64(co[2]) + zh * uint64(co[3]))

    return gemm_batched
