"""``train.precision = "bf16"`` on the CUDA backend: the CPU reference's rounding points (backend/cpu/precision.py),
on the device.

Every product (the Linear forward out = X·Wᵀ + b, its two backward products dY·W and dYᵀ·X, the LM head, and
math attention's q·kᵀ, att·v and their backward products) takes its inputs rounded to bfloat16 (to nearest even:
the ``round_bf16`` kernel, activations.py) and rounds its output; the bias is rounded and added before the
output's rounding; a weight gradient accumulated over micro-batches is rounded before it is added in float32.
Everything else stays float32, as on the CPU: LayerNorm, softmax, GELU, dropout, the loss, residual adds, the
bias gradient and the master state (parameters, gradients, optimizer state, checkpoints).

Where the bfloat16 values are held: what a Linear keeps for its backward (``product_input``: nn/layers.py) is
bfloat16, as 16-bit words (``bf16_storage`` uint16; ``to_bf16``, activations.py), half the bytes; so are the q, k
and v attention keeps (read by its backward's products only), and an activation's input where a Linear wrote it
(``kept_output``; ``gelu_backward_bf16`` and ``relu_backward_bf16`` widen the words as they read them). Inside a
part's passes a product reads its weight from the part's one bfloat16 copy of its parameters, rounded at each
forward (``ProductWeights``, backend/product_weights.py), rather than rounding it itself. A product's
operands go to the GEMM provider as bfloat16 where it is cuBLASLt (a bf16 GEMM with float32 accumulation on the
tensor cores, the output float32, then rounded; gemm/__init__.py), and as float32 arrays of bfloat16 values
where it is tiled.py's kernels (a float32 operand rounded by ``round_bf16``, a bfloat16 one widened by
``from_bf16``). Math attention's products take its heads as bfloat16 copies with cuBLASLt (attention.py), rounded
float32 copies in tiled.py's batched kernels (kept bfloat16 q, k, v copied as they are, or widened). The other
activations (the residual stream at each LayerNorm, attention's probabilities), the gradients and the master state
stay float32 (hpctrain plan counts what each holds).
Flash attention rounds inside its kernels on the CPU reference; its CUDA kernels do not, so
``model.attention = "flash"`` is refused here in one line.

    be = Bf16CudaBackend()      # get_backend("cuda", precision="bf16")
"""

from __future__ import annotations

import numpy as np

from ...errors import BackendError
from ..product_weights import ProductWeights
from . import CudaBackend
from .gemm import address
from .memory import flat

__all__ = ["Bf16CudaBackend"]


class Bf16CudaBackend(ProductWeights, CudaBackend):
    """CudaBackend whose products round their inputs and outputs to bfloat16 (this module's docstring); inside a
    part's passes they read its weights from one bfloat16 copy (backend/product_weights.py)."""

    precision = "bf16"

    bf16_storage = np.dtype(np.uint16)  # a bfloat16 array on the device: its 16-bit words

    def _bf16_copy(self, n):
        """Held across steps: never from the step arena (made at a step's first forward)."""
        return self._fresh((n,), self.bf16_storage)

    def _round_into(self, data, copy):
        self._elementwise(self._k.to_bf16, data.size, flat(data).view(np.uint32), copy)

    _address = staticmethod(address)

    @staticmethod
    def _contiguous(x) -> bool:
        return x.is_c_contiguous()

    def round_bf16_(self, x, out=None):
        """``out`` (default: ``x`` itself) = ``x`` rounded to bfloat16, to nearest even; both C-contiguous float32."""
        out = x if out is None else out
        self._unary_args("round_bf16", x, out)
        if x.size:
            self._elementwise(self._k.round_bf16, x.size, flat(x).view(np.uint32), flat(out).view(np.uint32))
        return out

    def empty_product_input(self, shape):
        return self._alloc("empty_product_input", shape, self.bf16_storage)

    def product_input(self, x):
        """A bfloat16 copy of ``x`` (uint16 words, rounded as ``round_bf16``); one already bfloat16 as it is."""
        if x.dtype == self.bf16_storage:
            return x
        self._arg("product_input", "x", x)
        out = self._alloc("product_input", x.shape, self.bf16_storage)
        if x.size:
            self._elementwise(self._k.to_bf16, x.size, flat(x).view(np.uint32), flat(out))
        return out

    def _rounded(self, op, x):
        """A new float32 array of ``x`` rounded to bfloat16 (None stays None)."""
        return None if x is None else self.round_bf16_(x, self._alloc(op, x.shape, np.float32))

    def _operand(self, op, x):
        """``x`` as the GEMM provider takes it: bfloat16 words for cuBLASLt, else float32 of bfloat16 values (a
        bfloat16 operand as it is: gemm/__init__.py widens it where tiled.py's kernels run the product)."""
        if x.dtype == self.bf16_storage:
            return x
        held = self._held_weight(x)  # a weight inside a part's passes: its held copy (product_weights.py)
        if held is not None:
            return held
        return self.product_input(x) if self._cublaslt is not None else self._rounded(op, x)

    def _product_input(self, op, x):
        """tiled.py's attention products' operand: a float32 copy rounded to bfloat16, or of a bfloat16 ``x``
        (the q, k and v attention keeps) widened."""
        return self._widened(x) if x.dtype == self.bf16_storage else self._rounded(op, x)

    def _product_output_(self, x) -> None:
        self.round_bf16_(x)

    def matmul_nt(self, a, b, out, bias=None):
        """out[M,N] = bf16(bf16(a)·bf16(b)ᵀ + bf16(bias)), accumulated in float32."""
        self._matmul_args("matmul_nt", a, b, out, bias)
        super().matmul_nt(self._operand("matmul_nt", a), self._operand("matmul_nt", b), out,
                          self._rounded("matmul_nt", bias))
        self.round_bf16_(out)

    def matmul_nn(self, a, b, out):
        """out[M,N] = bf16(bf16(a)·bf16(b))."""
        self._matmul_args("matmul_nn", a, b, out)
        super().matmul_nn(self._operand("matmul_nn", a), self._operand("matmul_nn", b), out)
        self.round_bf16_(out)

    def matmul_tn(self, a, b, out, accumulate=False):
        """out[M,N] (+)= bf16(bf16(a)ᵀ·bf16(b)): the weight gradient rounded, then added in float32."""
        self._matmul_args("matmul_tn", a, b, out)
        product = self._alloc("matmul_tn", out.shape, np.float32) if accumulate else out
        super().matmul_tn(self._operand("matmul_tn", a), self._operand("matmul_tn", b), product)
        self.round_bf16_(product)
        if accumulate:
            self.add_(out, product)

    def flash_attention_forward(self, *args, **kwargs):
        raise BackendError(_NO_FLASH)

    def flash_attention_backward(self, *args, **kwargs):
        raise BackendError(_NO_FLASH)


_NO_FLASH = ('model.attention = "flash" with train.precision = "bf16" is not built on the CUDA backend yet (its '
             'kernels would have to round inside); use attention = "math" there, or precision = "fp32"')
