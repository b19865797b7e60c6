"""The GEMM provider of the CUDA backend: every matrix product of a step goes through ``Gemm``'s three methods.

    _gemm(layout, a, b, out, M, N, K, bias, epilogue)        c = a·b in layout NT, NN or TN (Linear's products)
    _split_k(tile, a, b, out, M, N, K, splits, accumulate)   a weight gradient under a wave, split along K
    _batched(tile, layout, a, b, c, M, N, K, k_total, H, Z, ao, bo, co, mode)   Z products (attention, split-K)

tiled.py is the provider today: numba kernels, a shared-memory tiled, register-blocked GEMM per ``GemmTile``,
with the tile table and the choice of tiling and K-splits. The layouts: NT out = a[M,K]·b[N,K]ᵀ, NN out =
a[M,K]·b[K,N], TN out = a[K,M]ᵀ·b[K,N] (tiled.py's kernel order).
"""

from __future__ import annotations

import numpy as np

from ..memory import flat
from .tiled import (EPI_ACCUMULATE, MAX_GRID_Z, MODE_SPLIT_K, batched_gemm_kernels, choose_tile, gemm_kernels,
                    k_splits, launch_config)

__all__ = ["Gemm", "NT", "NN", "TN"]

NT, NN, TN = 0, 1, 2  # the operand layouts, in the order tiled.py returns its kernels


class Gemm:
    """CudaBackend's GEMM launches (a mixin: ``self.tiles``, ``self.tn_tiles`` and ``self.wave`` choose the
    tiling, ``self._launch`` launches)."""

    def _gemm(self, layout, a, b, out, M, N, K, bias, epilogue):
        if M == 0 or N == 0:
            return
        tile = choose_tile(self.tn_tiles if layout == TN else self.tiles, self.wave, M, N)
        splits = k_splits(tile, self.wave, M, N, K) if layout == TN else 1
        if splits > 1:
            self._split_k(tile, a, b, out, M, N, K, splits, epilogue == EPI_ACCUMULATE)
            return
        grid, threads = launch_config(tile, M, N)
        kernel = gemm_kernels(tile)[layout]
        self._launch(kernel, grid, threads, a, b, out, self._no_bias if bias is None else bias, M, N, K, epilogue)

    def _split_k(self, tile, a, b, out, M, N, K, splits, accumulate):
        """out[M,N] (+)= a[K,M]ᵀ·b[K,N] as ``splits`` partial products over K slices into a workspace, then
        summed slice by slice in order (deterministic)."""
        ks = -(-K // splits)
        ws = self._alloc("matmul_tn", (splits * M, N), np.float32)
        self._batched(tile, TN, a, b, ws, M, N, ks, K, 1, splits, (ks, 0, 0, 0), (ks, 0, 0, 0), (M, 0, 0, 0),
                      MODE_SPLIT_K)
        sum_splits = batched_gemm_kernels(tile)[3]
        self._launch(sum_splits, self._grid(M * N), self.block, flat(ws), flat(out), splits, bool(accumulate))

    def _batched(self, tile, layout, a, b, c, M, N, K, k_total, H, Z, ao, bo, co, mode):
        """Z batched products (tiled.py's batched kernels), in launches of at most MAX_GRID_Z."""
        kernel = batched_gemm_kernels(tile)[layout]
        for z0 in range(0, Z, MAX_GRID_Z):
            grid, threads = launch_config(tile, M, N, min(MAX_GRID_Z, Z - z0))
            self._launch(kernel, grid, threads, a, b, c, M, N, K, k_total, H, z0, ao, bo, co, mode)
