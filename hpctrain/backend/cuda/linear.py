"""The Linear layer's products and bias on the GPU: out = X·Wᵀ (+ bias), dY·W, dYᵀ·X, and the bias gradient.

The products go to the GEMM provider (gemm/: ``_gemm``); the bias is fused into the forward product's store. The
bias gradient is a column sum in one launch of two passes (``bias_grad``: per row group, then the last block of each
column block adds the groups; blocks.py), in float64 as the CPU backend's (cpu/linear.py).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import cuda, float64, int64

from . import blocks
from .gemm import NN, NT, TN
from .gemm.tiled import EPI_ACCUMULATE, EPI_BIAS, EPI_STORE

__all__ = ["kernels", "Linear"]


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """The bias gradient for blocks of ``nt`` threads; compiled lazily, once per process."""
    kernel = blocks.kernel_decorator(nt)
    red = blocks.block_reducers(nt)
    column_sum, finish_columns, RX, RY = red.column_sum, red.finish_columns, red.RX, red.RY
    last_to_finish = blocks.last_to_finish

    @kernel
    def bias_grad(dout, partial, counters, rows_per, dbias, accumulate):
        """dbias[C] (+)= Σ_rows dout[B, C] in float64, in one launch: block (bx, by) adds rows [by·rows_per,
        +rows_per) of its RX columns into partial[bx, by, 0:RX]; the last of column block bx's gridDim.y blocks
        (counters[bx]) adds them (blocks.py's finish_columns)."""
        sh = cuda.shared.array((RY, RX), float64)
        sh_last = cuda.shared.array(1, int64)
        B, C = dout.shape
        col = cuda.blockIdx.x * RX + cuda.threadIdx.x
        lo = cuda.blockIdx.y * rows_per
        hi = min(B, lo + rows_per)
        acc = float64(0.0)
        if col < C:
            for i in range(lo + cuda.threadIdx.y, hi, RY):
                acc += float64(dout[i, col])
        total = column_sum(sh, acc)
        if cuda.threadIdx.y == 0 and col < C:
            partial[cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x] = total
        if last_to_finish(sh_last, counters, cuda.blockIdx.x, cuda.gridDim.y):
            finish_columns(sh, partial, cuda.gridDim.y, dbias, accumulate)

    return SimpleNamespace(bias_grad=bias_grad)


class Linear:
    """CudaBackend's matrix products (X·Wᵀ, dY·W, dYᵀ·X) and bias gradient (a mixin)."""

    def matmul_nt(self, a, b, out, bias=None):
        """out[M,N] = a[M,K] @ b[N,K]ᵀ (+ bias[N]): the Linear forward, bias fused into the store."""
        M, N, K = self._matmul_args("matmul_nt", a, b, out, bias)
        self._gemm(NT, a, b, out, M, N, K, bias, EPI_STORE if bias is None else EPI_BIAS)

    def matmul_nn(self, a, b, out):
        """out[M,N] = a[M,K] @ b[K,N]: the Linear input gradient dY·W."""
        M, N, K = self._matmul_args("matmul_nn", a, b, out)
        self._gemm(NN, a, b, out, M, N, K, None, EPI_STORE)

    def matmul_tn(self, a, b, out, accumulate=False):
        """out[M,N] (+)= a[K,M]ᵀ @ b[K,N]: the Linear weight gradient dYᵀ·X."""
        M, N, K = self._matmul_args("matmul_tn", a, b, out)
        self._gemm(TN, a, b, out, M, N, K, None, EPI_ACCUMULATE if accumulate else EPI_STORE)

    def bias_grad(self, dout, dbias, accumulate=False):
        """dbias[C] (+)= Σ_rows dout[B,C], accumulated in float64 (one launch: ``_column_sums``)."""
        C = self._bias_grad_args(dout, dbias)
        if C:
            self._column_sums("bias_grad", self._k.bias_grad, dout.shape[0], C, dout, dbias, accumulate)
