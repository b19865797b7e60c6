"""``train.precision = "bf16"`` on the CPU: the reference for mixed-precision training, PyTorch's bf16 autocast.

Every product (the Linear forward out = X·Wᵀ + b, its two backward products dY·W and dYᵀ·X, the LM head, which is
a Linear on the tied table, and attention's q·kᵀ, att·v and their backward products) takes its inputs rounded to
bfloat16 (to nearest even, ``ml_dtypes``' cast), accumulates in float32 (numpy's BLAS) and rounds its output to
bfloat16, as a bf16 GEMM with float32 accumulation does. The Linear's bias is rounded too and added before the
output's rounding (autocast's ``addmm``); a later micro-batch's weight gradient is rounded before it is added to the
float32 gradient (autocast's cast back to the float32 parameter). Everything else stays float32: LayerNorm and its
statistics, softmax (its 1/√hs scale applied in float32 inside it), GELU, dropout, the loss and its gradient,
residual adds, the bias gradient, and the master state (parameters, gradients, optimizer state, checkpoints).

Arrays keep the backend's contract (float32, C-contiguous) but for one kind: what a product reads and a layer keeps
for its backward, ``product_input(x)``, is a bfloat16 array (``ml_dtypes``, half the bytes), which the products take
as it is. A Linear keeps its input so (nn/layers.py), as autocast keeps the bf16 copy its matmul made, and
attention its q, k and v (nn/gpt.py); an activation right after a Linear keeps its input, that product's output, as
``kept_output(x)`` (the same copy, exact: the product rounded x), which ``relu_backward`` and ``gelu_backward`` widen
to float32 for their kernels. Inside a part's passes the products read its weights from one bfloat16 copy of its
flat parameters, rounded at each forward (``ProductWeights``, backend/product_weights.py). Everything else, MPI's
messages and the checkpoints hold float32 (a bfloat16 value as the float32 of the same value).

    be = Bf16CpuBackend()      # get_backend("cpu", precision="bf16")
"""

from __future__ import annotations

import numpy as np

from ..product_weights import ProductWeights
from . import CpuBackend

__all__ = ["Bf16CpuBackend", "to_bf16", "round_bf16_"]


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def to_bf16(x) -> np.ndarray:
    """A new float32 array of ``x`` rounded to bfloat16 (to nearest even; a bfloat16 ``x`` widened, no copy
    of it made first)."""
    return np.asarray(x).astype(_bfloat16(), copy=False).astype(np.float32)


def round_bf16_(x: np.ndarray) -> np.ndarray:
    """``x`` (float32, any strides) rounded to bfloat16 in place; returns it."""
    x[...] = x.astype(_bfloat16())
    return x


class Bf16CpuBackend(ProductWeights, CpuBackend):
    """CpuBackend whose products round their inputs and outputs to bfloat16 (this module's docstring); inside a
    part's passes they read its weights from one bfloat16 copy (backend/product_weights.py)."""

    precision = "bf16"

    def _bf16_copy(self, n):
        return np.empty(n, _bfloat16())

    @staticmethod
    def _round_into(data, copy):
        copy[...] = data  # ml_dtypes' cast: to nearest even

    @staticmethod
    def _address(x) -> int:
        return x.__array_interface__["data"][0]

    @staticmethod
    def _contiguous(x) -> bool:
        return x.flags.c_contiguous

    def _weight(self, x):
        """A product's operand: a weight's held bfloat16 copy where there is one (``_held_weight``), else x."""
        held = self._held_weight(x)
        return x if held is None else held

    @property
    def bf16_storage(self):
        return _bfloat16()

    def empty_product_input(self, shape):
        return np.empty(shape, _bfloat16())

    def product_input(self, x):
        """A bfloat16 copy of ``x`` (rounded to nearest even; one already bfloat16 as it is)."""
        return x if x.dtype == _bfloat16() else np.asarray(x).astype(_bfloat16())

    def matmul_nt(self, a, b, out, bias=None):
        """out[M,N] = bf16(bf16(a)·bf16(b)ᵀ + bf16(bias)), accumulated in float32."""
        self._matmul_args("matmul_nt", a, b, out, bias)
        np.matmul(to_bf16(a), to_bf16(self._weight(b)).T, out=out)
        if bias is not None:
            out += to_bf16(self._weight(bias))
        round_bf16_(out)

    def matmul_nn(self, a, b, out):
        """out[M,N] = bf16(bf16(a)·bf16(b))."""
        self._matmul_args("matmul_nn", a, b, out)
        np.matmul(to_bf16(a), to_bf16(self._weight(b)), out=out)
        round_bf16_(out)

    def matmul_tn(self, a, b, out, accumulate=False):
        """out[M,N] (+)= bf16(bf16(a)ᵀ·bf16(b)): the weight gradient rounded, then added in float32."""
        self._matmul_args("matmul_tn", a, b, out)
        product = round_bf16_(to_bf16(a).T @ to_bf16(b))
        if accumulate:
            out += product
        else:
            np.copyto(out, product)

    @staticmethod
    def _bmm(a, b, out=None):
        """attention's batched products: bf16(bf16(a)·bf16(b)), into ``out`` (any strides) or a new array."""
        return round_bf16_(np.matmul(to_bf16(a), to_bf16(b), out=out))
