"""The Linear layer's products and bias on the CPU: out = X·Wᵀ (+ bias), dY·W, dYᵀ·X through numpy's BLAS (a later
micro-batch's weight gradient added inside the GEMM where blas.py allows), the bias add and gradient ``numba.njit``.

Shape letters: B rows, C features, M/N/K a product's output rows, columns and reduction size.
"""

from __future__ import annotations

import numpy as np

from .activations import add_inplace
from .jit import jit

__all__ = ["Linear"]


@jit
def _bias_add(y, bias):
    B, C = y.shape
    for i in range(B):
        for j in range(C):
            y[i, j] += bias[j]


@jit
def _bias_grad(dout, dbias, accumulate):
    B, C = dout.shape
    acc = np.zeros(C, dtype=np.float64)
    for i in range(B):
        for j in range(C):
            acc[j] += dout[i, j]
    for j in range(C):
        dbias[j] = (dbias[j] + acc[j]) if accumulate else acc[j]


class Linear:
    """CpuBackend's matrix products and bias gradient (a mixin; ``self._sgemm``: blas.py's, or None)."""

    def matmul_nt(self, a, b, out, bias=None):
        """out[M,N] = a[M,K] @ b[N,K]ᵀ (+ bias[N]): the Linear forward."""
        self._matmul_args("matmul_nt", a, b, out, bias)
        np.matmul(a, b.T, out=out)
        if bias is not None:
            _bias_add(out, bias)

    def matmul_nn(self, a, b, out):
        """out[M,N] = a[M,K] @ b[K,N]: the Linear input gradient dY·W."""
        self._matmul_args("matmul_nn", a, b, out)
        np.matmul(a, b, out=out)

    def matmul_tn(self, a, b, out, accumulate=False):
        """out[M,N] (+)= a[K,M]ᵀ @ b[K,N]: the Linear weight gradient dYᵀ·X."""
        self._matmul_args("matmul_tn", a, b, out)
        if accumulate and self._sgemm is not None:
            self._sgemm.tn_accumulate(a, b, out)
        elif accumulate:
            add_inplace(out, a.T @ b)
        else:
            np.matmul(a.T, b, out=out)

    def bias_grad(self, dout, dbias, accumulate=False):
        self._bias_grad_args(dout, dbias)
        _bias_grad(dout, dbias, accumulate)
