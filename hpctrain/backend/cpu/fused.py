"""The residual add fused with the LayerNorm after it, on the CPU, forward and backward (``numba.njit``): a GPT
block's ``x2 = x2 + x; h2 = ln_2(x2)`` in one pass over the rows, and its gradient ``dx2 = ln_2'(dh2) + dout``.
The arithmetic is norm.py's and activations.py's add, in the same order. Shape letters: B rows, C features.
"""

from __future__ import annotations

import math

import numpy as np

from .jit import jit_reduce

__all__ = ["Fused"]


@jit_reduce
def _residual_layernorm_forward(x, residual, weight, bias, eps, out, mean, rstd):
    B, C = x.shape
    for i in range(B):
        m = 0.0
        for j in range(C):
            x[i, j] += residual[i, j]  # the residual add: x is the stream after it
            m += x[i, j]
        m /= C
        v = 0.0
        for j in range(C):
            d = x[i, j] - m
            v += d * d
        v /= C
        s = 1.0 / math.sqrt(v + eps)
        for j in range(C):
            out[i, j] = (x[i, j] - m) * s * weight[j] + bias[j]
        mean[i] = m
        rstd[i] = s


@jit_reduce
def _residual_layernorm_backward(dout, dresidual, x, weight, mean, rstd, dinp, dweight, dbias, accumulate):
    B, C = x.shape
    dw = np.zeros(C, dtype=np.float64)
    db = np.zeros(C, dtype=np.float64)
    for i in range(B):
        m = np.float64(mean[i])
        s = np.float64(rstd[i])
        sum_dn = 0.0
        sum_dn_n = 0.0
        for j in range(C):
            n = (x[i, j] - m) * s
            dn = np.float64(dout[i, j]) * weight[j]
            sum_dn += dn
            sum_dn_n += dn * n
            dw[j] += dout[i, j] * n
            db[j] += dout[i, j]
        sum_dn /= C
        sum_dn_n /= C
        for j in range(C):
            n = (x[i, j] - m) * s
            dn = np.float64(dout[i, j]) * weight[j]
            # the LayerNorm's gradient rounded to float32, then the residual's added: the unfused bits
            dinp[i, j] = np.float32(s * (dn - sum_dn - n * sum_dn_n)) + dresidual[i, j]
    for j in range(C):
        dweight[j] = (dweight[j] + dw[j]) if accumulate else dw[j]
        dbias[j] = (dbias[j] + db[j]) if accumulate else db[j]


class Fused:
    """CpuBackend's fused residual add + LayerNorm (a mixin; base.Backend has the contract and the unfused
    sequence)."""

    def residual_layernorm_forward(self, x, residual, weight, bias, eps, out, mean, rstd):
        """x[B,C] += residual, then out = LayerNorm(x); saves mean[B], rstd[B]."""
        self._residual_layernorm_forward_args(x, residual, weight, bias, out, mean, rstd)
        _residual_layernorm_forward(x, residual, weight, bias, float(eps), out, mean, rstd)

    def residual_layernorm_backward(self, dout, dresidual, x, weight, mean, rstd, dinp, dweight, dbias,
                                    accumulate=False):
        """dinp = the LayerNorm's input gradient + dresidual; dweight, dbias (+)= their sums over the rows."""
        self._residual_layernorm_backward_args(dout, dresidual, x, weight, mean, rstd, dinp, dweight, dbias)
        _residual_layernorm_backward(dout, dresidual, x, weight, mean, rstd, dinp, dweight, dbias, accumulate)
