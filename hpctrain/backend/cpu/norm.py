"""LayerNorm on the CPU, forward and backward (``numba.njit``; the parameter gradients summed over the rows in
float64). Shape letters: B rows, C features.
"""

from __future__ import annotations

import math

import numpy as np

from .jit import jit_reduce

__all__ = ["Norm"]


@jit_reduce
def _layernorm_forward(x, weight, bias, eps, out, mean, rstd):
    B, C = x.shape
    for i in range(B):
        m = 0.0
        for j in range(C):
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
def _layernorm_backward(dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate):
    B, C = x.shape
    dw = np.zeros(C, dtype=np.float64)
    db = np.zeros(C, dtype=np.float64)
    for i in range(B):
        m = np.float64(mean[i])
        s = np.float64(rstd[i])
        # dnorm = dout * weight; dx = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
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
            dinp[i, j] = s * (dn - sum_dn - n * sum_dn_n)
    for j in range(C):
        dweight[j] = (dweight[j] + dw[j]) if accumulate else dw[j]
        dbias[j] = (dbias[j] + db[j]) if accumulate else db[j]


class Norm:
    """CpuBackend's LayerNorm (a mixin)."""

    def layernorm_forward(self, x, weight, bias, eps, out, mean, rstd):
        self._layernorm_forward_args(x, weight, bias, out, mean, rstd)
        if out.dtype == np.float32:
            _layernorm_forward(x, weight, bias, float(eps), out, mean, rstd)
            return
        wide = np.empty(out.shape, np.float32)  # empty_product_input's bfloat16: rounded as the product would
        _layernorm_forward(x, weight, bias, float(eps), wide, mean, rstd)
        out[...] = wide

    def layernorm_backward(self, dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate=False):
        self._layernorm_backward_args(dout, x, weight, mean, rstd, dinp, dweight, dbias)
        _layernorm_backward(dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate)
