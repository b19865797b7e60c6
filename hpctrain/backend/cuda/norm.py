"""LayerNorm on the GPU, forward and backward.

Shape letters: B rows, C features. The forward and the input gradient are row kernels (one block per row,
grid-stride over rows; the block's threads stride over the C columns and combine through a shared-memory tree);
the parameter gradients are column sums in two passes (``layernorm_params_partials`` here, then blocks.py's
``column_finish``, launched by ``CudaBackend._column_sums``), accumulated in float64 as the CPU backend's are
(cpu/norm.py).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, float64

from . import blocks

__all__ = ["kernels", "Norm"]

_ONE = np.float32(1.0)


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """The LayerNorm kernels for blocks of ``nt`` threads; compiled lazily, once per process."""
    NT, kernel = nt, blocks.kernel_decorator(nt)
    red = blocks.block_reducers(nt)
    block_sum, column_sum, RX, RY = red.block_sum, red.column_sum, red.RX, red.RY

    @kernel
    def layernorm_forward(x, weight, bias, eps, out, mean, rstd):
        """out[B,C] = (x − mean)·rstd·weight + bias per row; saves mean[B], rstd[B] (two-pass variance)."""
        sh = cuda.shared.array(NT, float32)
        B, C = x.shape
        inv_c = _ONE / float32(C)
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            acc = float32(0.0)
            for j in range(t, C, NT):
                acc += x[row, j]
            m = block_sum(sh, acc) * inv_c
            acc = float32(0.0)
            for j in range(t, C, NT):
                d = x[row, j] - m
                acc += d * d
            r = _ONE / math.sqrt(block_sum(sh, acc) * inv_c + eps)
            for j in range(t, C, NT):
                out[row, j] = (x[row, j] - m) * r * weight[j] + bias[j]
            if t == 0:
                mean[row] = m
                rstd[row] = r

    @kernel
    def layernorm_backward_rows(dout, x, weight, mean, rstd, dinp):
        """dinp = rstd·(dn − mean(dn) − n·mean(dn·n)) with n the normalised x and dn = dout·weight."""
        sh = cuda.shared.array(NT, float32)
        B, C = x.shape
        inv_c = _ONE / float32(C)
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            m = mean[row]
            r = rstd[row]
            acc_dn = float32(0.0)
            acc_dn_n = float32(0.0)
            for j in range(t, C, NT):
                dn = dout[row, j] * weight[j]
                acc_dn += dn
                acc_dn_n += dn * (x[row, j] - m) * r
            mean_dn = block_sum(sh, acc_dn) * inv_c
            mean_dn_n = block_sum(sh, acc_dn_n) * inv_c
            for j in range(t, C, NT):
                n = (x[row, j] - m) * r
                dinp[row, j] = r * (dout[row, j] * weight[j] - mean_dn - n * mean_dn_n)

    @kernel
    def layernorm_params_partials(dout, x, mean, rstd, partial, rows_per):
        """Column sums, pass 1, for LayerNorm's dweight and dbias: block (bx, by) adds rows [by·rows_per,
        +rows_per) in float64: partial[by, col] = Σ dout·n, partial[G + by, col] = Σ dout (G = gridDim.y)."""
        sh_w = cuda.shared.array((RY, RX), float64)
        sh_b = cuda.shared.array((RY, RX), float64)
        B, C = x.shape
        col = cuda.blockIdx.x * RX + cuda.threadIdx.x
        lo = cuda.blockIdx.y * rows_per
        hi = min(B, lo + rows_per)
        acc_w = float64(0.0)
        acc_b = float64(0.0)
        if col < C:
            for i in range(lo + cuda.threadIdx.y, hi, RY):
                d = dout[i, col]
                acc_w += float64(d * (x[i, col] - mean[i]) * rstd[i])
                acc_b += float64(d)
        total_w = column_sum(sh_w, acc_w)
        total_b = column_sum(sh_b, acc_b)
        if cuda.threadIdx.y == 0 and col < C:
            partial[cuda.blockIdx.y, col] = total_w
            partial[cuda.gridDim.y + cuda.blockIdx.y, col] = total_b

    return SimpleNamespace(layernorm_forward=layernorm_forward, layernorm_backward_rows=layernorm_backward_rows,
                           layernorm_params_partials=layernorm_params_partials)


class Norm:
    """CudaBackend's LayerNorm (a mixin)."""

    def layernorm_forward(self, x, weight, bias, eps, out, mean, rstd):
        """out[B,C] = (x − mean)·rstd·weight + bias; saves mean[B] and rstd[B] for the backward pass."""
        B, C = self._layernorm_forward_args(x, weight, bias, out, mean, rstd)
        if B and C:
            self._launch(self._k.layernorm_forward, self._rows_grid(B), self.block,
                         x, weight, bias, np.float32(eps), out, mean, rstd)

    def layernorm_backward(self, dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate=False):
        """dinp[B,C]; dweight[C], dbias[C] (+)= their sums over the rows."""
        B, C = self._layernorm_backward_args(dout, x, weight, mean, rstd, dinp, dweight, dbias)
        if not C:
            return
        k = self._k
        if B:
            self._launch(k.layernorm_backward_rows, self._rows_grid(B), self.block, dout, x, weight, mean, rstd, dinp)
        self._column_sums("layernorm_backward", k.layernorm_params_partials, B, C, 2, (dout, x, mean, rstd),
                          (dweight, dbias), accumulate)
