"""LayerNorm on the GPU, forward and backward.

Shape letters: B rows, C features. The forward and the input gradient are row kernels (one block per row,
grid-stride over rows; the block's threads stride over the C columns and combine through a shared-memory tree);
the parameter gradients are column sums accumulated in float64 as the CPU backend's are (cpu/norm.py), in the
input gradient's launch: each block of rows keeps float64 partial sums of its rows, and the last block to finish
adds them in a fixed order (blocks.py's ``last_to_finish``: deterministic, llm.c's layernorm_backward). The
residual add before a LayerNorm (``residual_layernorm_forward``) and the residual's gradient after its backward
(``residual_layernorm_backward``) are fused into the same kernels.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, float64, int64

from . import blocks
from .activations import bf16_narrower

__all__ = ["kernels", "Norm"]

_ONE = np.float32(1.0)


@cuda.jit(device=True)
def _as_is(v):
    return v


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """The LayerNorm kernels for blocks of ``nt`` threads; compiled lazily, once per process."""
    NT, kernel = nt, blocks.kernel_decorator(nt)
    red = blocks.block_reducers(nt)
    block_sum = red.block_sum
    last_to_finish = blocks.last_to_finish

    def forward(store, name):
        """The forward kernel, each output value written as ``store`` makes it: float32 as it is, or bfloat16
        words (``layernorm_forward_bf16``, whose output a product alone reads: ``empty_product_input``)."""

        def layernorm_forward(x, residual, add_residual, weight, bias, eps, out, mean, rstd):
            """out[B,C] = (x − mean)·rstd·weight + bias per row; saves mean[B], rstd[B] (two-pass variance). With
            ``add_residual``, x += residual[B,C] first (the residual add fused: each thread adds, stores and then
            reads back only its own elements)."""
            sh = cuda.shared.array(NT, float32)
            B, C = x.shape
            inv_c = _ONE / float32(C)
            t = cuda.threadIdx.x
            for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
                acc = float32(0.0)
                for j in range(t, C, NT):
                    v = x[row, j]
                    if add_residual:
                        v += residual[row, j]
                        x[row, j] = v
                    acc += v
                m = block_sum(sh, acc) * inv_c
                acc = float32(0.0)
                for j in range(t, C, NT):
                    d = x[row, j] - m
                    acc += d * d
                r = _ONE / math.sqrt(block_sum(sh, acc) * inv_c + eps)
                for j in range(t, C, NT):
                    out[row, j] = store((x[row, j] - m) * r * weight[j] + bias[j])
                if t == 0:
                    mean[row] = m
                    rstd[row] = r

        layernorm_forward.__name__ = layernorm_forward.__qualname__ = name
        return kernel(layernorm_forward)

    layernorm_forward = forward(_as_is, "layernorm_forward")
    layernorm_forward_bf16 = forward(bf16_narrower(), "layernorm_forward_bf16")

    @kernel
    def layernorm_backward(dout, x, weight, mean, rstd, dinp, dresidual, add_residual, partial, counters, dweight,
                           dbias, accumulate):
        """One launch: dinp = rstd·(dn − mean(dn) − n·mean(dn·n)) (+ dresidual with ``add_residual``) with n the
        normalised x and dn = dout·weight; dweight[C], dbias[C] (+)= Σ_rows dout·n, Σ_rows dout in float64.
        Block g (of G = gridDim.x) adds its rows' into partial[g, C] and partial[G + g, C] (each thread its own
        columns: no races), and the last block to finish adds the G partials of each column in order of g."""
        sh = cuda.shared.array(NT, float32)
        sh_last = cuda.shared.array(1, int64)
        B, C = x.shape
        G = cuda.gridDim.x
        g = cuda.blockIdx.x
        inv_c = _ONE / float32(C)
        t = cuda.threadIdx.x
        for j in range(t, C, NT):
            partial[g, j] = 0.0
            partial[G + g, j] = 0.0
        for row in range(g, B, G):
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
                d = dout[row, j]
                n = (x[row, j] - m) * r
                v = r * (d * weight[j] - mean_dn - n * mean_dn_n)
                if add_residual:
                    v += dresidual[row, j]
                dinp[row, j] = v
                partial[g, j] += float64(d * n)
                partial[G + g, j] += float64(d)
        if last_to_finish(sh_last, counters, 0, G):
            for j in range(t, C, NT):
                total_w = float64(0.0)
                total_b = float64(0.0)
                for h in range(G):
                    total_w += partial[h, j]
                    total_b += partial[G + h, j]
                if accumulate:
                    total_w += float64(dweight[j])
                    total_b += float64(dbias[j])
                dweight[j] = float32(total_w)
                dbias[j] = float32(total_b)

    return SimpleNamespace(layernorm_forward=layernorm_forward, layernorm_forward_bf16=layernorm_forward_bf16,
                           layernorm_backward=layernorm_backward)


class Norm:
    """CudaBackend's LayerNorm (a mixin), and LayerNorm with the residual add before it fused in."""

    def layernorm_forward(self, x, weight, bias, eps, out, mean, rstd):
        """out[B,C] = (x − mean)·rstd·weight + bias; saves mean[B] and rstd[B] for the backward pass. An ``out``
        held in ``bf16_storage`` (``empty_product_input``) is written rounded to bfloat16 by the same launch."""
        B, C = self._layernorm_forward_args(x, weight, bias, out, mean, rstd)
        if B and C:
            self._launch(self._forward_kernel(out), self._rows_grid(B), self.block,
                         x, x, False, weight, bias, np.float32(eps), out, mean, rstd)

    def _forward_kernel(self, out):
        return self._k.layernorm_forward_bf16 if out.dtype == self.bf16_storage else self._k.layernorm_forward

    def layernorm_backward(self, dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate=False):
        """dinp[B,C]; dweight[C], dbias[C] (+)= their sums over the rows, in one launch."""
        self._layernorm_backward_args(dout, x, weight, mean, rstd, dinp, dweight, dbias)
        self._layernorm_backward(dout, x, weight, mean, rstd, dinp, None, dweight, dbias, accumulate)

    def residual_layernorm_forward(self, x, residual, weight, bias, eps, out, mean, rstd):
        """x[B,C] += residual, then ``layernorm_forward`` of it, in one launch."""
        B, C = self._residual_layernorm_forward_args(x, residual, weight, bias, out, mean, rstd)
        if B and C:
            self._launch(self._forward_kernel(out), self._rows_grid(B), self.block,
                         x, residual, True, weight, bias, np.float32(eps), out, mean, rstd)

    def residual_layernorm_backward(self, dout, dresidual, x, weight, mean, rstd, dinp, dweight, dbias,
                                    accumulate=False):
        """``layernorm_backward`` with dinp += dresidual (the gradient that the residual add passes through), in
        one launch."""
        self._residual_layernorm_backward_args(dout, dresidual, x, weight, mean, rstd, dinp, dweight, dbias)
        self._layernorm_backward(dout, x, weight, mean, rstd, dinp, dresidual, dweight, dbias, accumulate)

    def _layernorm_backward(self, dout, x, weight, mean, rstd, dinp, dresidual, dweight, dbias, accumulate):
        """The one launch of both backward methods: G = min(B, a wave) blocks of rows, at least one (it writes the
        parameter gradients when B = 0), each with float64 partials of both sums over its rows."""
        B, C = x.shape
        if not C:
            return
        G = max(1, min(B, self.wave if not self.simulator else self.max_blocks))
        partial = self._partials("layernorm_backward", 2 * G, C)
        self._launch(self._k.layernorm_backward, G, self.block, dout, x, weight, mean, rstd, dinp,
                     dinp if dresidual is None else dresidual, dresidual is not None, partial,
                     self._counter_slots(1), dweight, dbias, bool(accumulate))
