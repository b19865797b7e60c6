"""``train.precision = "bf16"`` on the CUDA backend: the CPU reference's rounding points (backend/cpu/precision.py),
on the device.

Every product (the Linear forward out = X·Wᵀ + b, its two backward products dY·W and dYᵀ·X, the LM head, and
math attention's q·kᵀ, att·v and their backward products) takes its inputs rounded to bfloat16 (to nearest even:
the ``round_bf16`` kernel, activations.py) and rounds its output; the bias is rounded and added before the
output's rounding; a weight gradient accumulated over micro-batches is rounded before it is added in float32.
Everything else stays float32, as on the CPU: LayerNorm, softmax, GELU, dropout, the loss, residual adds, the
bias gradient and the master state (parameters, gradients, optimizer state, checkpoints).

What this is and is not yet: the numerics of bf16 autocast, checked against the CPU reference under the
simulator (tests/cuda/test_cuda_bf16.py); the values are held as float32 arrays of bfloat16 values and the
products run in the float32 GEMM, so it neither saves memory nor reaches tensor cores. Those come with bfloat16
storage and the cuBLASLt provider's bf16 GEMMs (gemm/cublaslt.py), which this backend's rounding points define.
Flash attention rounds inside its kernels on the CPU reference; its CUDA kernels do not, so
``model.attention = "flash"`` is refused here in one line.

    be = Bf16CudaBackend()      # get_backend("cuda", precision="bf16")
"""

from __future__ import annotations

import numpy as np

from ...errors import BackendError
from . import CudaBackend
from .memory import flat

__all__ = ["Bf16CudaBackend"]


class Bf16CudaBackend(CudaBackend):
    """CudaBackend whose products round their inputs and outputs to bfloat16 (this module's docstring)."""

    precision = "bf16"

    def round_bf16_(self, x, out=None):
        """``out`` (default: ``x`` itself) = ``x`` rounded to bfloat16, to nearest even; both C-contiguous float32."""
        out = x if out is None else out
        self._unary_args("round_bf16", x, out)
        if x.size:
            self._elementwise(self._k.round_bf16, x.size, flat(x).view(np.uint32), flat(out).view(np.uint32))
        return out

    def _rounded(self, op, x):
        """A new array of ``x`` rounded to bfloat16 (None stays None)."""
        return None if x is None else self.round_bf16_(x, self._alloc(op, x.shape, np.float32))

    def _product_input(self, op, x):
        return self._rounded(op, x)

    def _product_output_(self, x) -> None:
        self.round_bf16_(x)

    def matmul_nt(self, a, b, out, bias=None):
        """out[M,N] = bf16(bf16(a)·bf16(b)ᵀ + bf16(bias)), accumulated in float32."""
        self._matmul_args("matmul_nt", a, b, out, bias)
        super().matmul_nt(self._rounded("matmul_nt", a), self._rounded("matmul_nt", b), out,
                          self._rounded("matmul_nt", bias))
        self.round_bf16_(out)

    def matmul_nn(self, a, b, out):
        """out[M,N] = bf16(bf16(a)·bf16(b))."""
        self._matmul_args("matmul_nn", a, b, out)
        super().matmul_nn(self._rounded("matmul_nn", a), self._rounded("matmul_nn", b), out)
        self.round_bf16_(out)

    def matmul_tn(self, a, b, out, accumulate=False):
        """out[M,N] (+)= bf16(bf16(a)ᵀ·bf16(b)): the weight gradient rounded, then added in float32."""
        self._matmul_args("matmul_tn", a, b, out)
        product = self._alloc("matmul_tn", out.shape, np.float32) if accumulate else out
        super().matmul_tn(self._rounded("matmul_tn", a), self._rounded("matmul_tn", b), product)
        self.round_bf16_(product)
        if accumulate:
            self.add_(out, product)

    def flash_attention_forward(self, *args, **kwargs):
        raise BackendError(_NO_FLASH)

    def flash_attention_backward(self, *args, **kwargs):
        raise BackendError(_NO_FLASH)


_NO_FLASH = ('model.attention = "flash" with train.precision = "bf16" is not built on the CUDA backend yet (its '
             'kernels would have to round inside); use attention = "math" there, or precision = "fp32"')
