"""CPU backend: matrix products through numpy's BLAS, everything else ``numba.njit``.

Shape letters: B batch rows, C features (channels), K reduction size,
M/N output rows/columns of a product. All arrays are float32 and C-contiguous
unless a docstring says otherwise (targets are int64). Kernels that produce a
gradient take ``accumulate``: False overwrites, True adds (micro-batches).
Compiled kernels are cached on disk (``cache=True``, jit.py) so a second run does not
recompile.

The package, a module per family of ops with forward and backward side by side, each holding its kernels and a
mixin class with the backend's methods for them (argument checks, then the kernel): linear.py (products through
blas.py, bias), activations.py (and the residual add), norm.py (the residual add + LayerNorm: base.py's unfused sequence), loss.py,
embedding.py, attention.py (math and flash paths), dropout.py, optim.py. This module is the class and its memory
methods; precision.py subclasses it for ``train.precision = "bf16"`` (every product's inputs and output rounded to
bfloat16).
"""

from __future__ import annotations

import numpy as np

from ..base import Backend
from .activations import Activations
from .attention import Attention
from .blas import Sgemm
from .dropout import Dropout
from .embedding import Embedding
from .linear import Linear
from .loss import Loss
from .norm import Norm
from .optim import Optim

__all__ = ["CpuBackend"]


class CpuBackend(Linear, Activations, Norm, Dropout, Embedding, Attention, Loss, Optim, Backend):
    """Arrays are numpy arrays in host memory."""

    name = "cpu"
    is_device = False

    def __init__(self):
        # out += aᵀ·b inside the GEMM where numpy's BLAS allows it (cpu/blas.py); None: a temporary and an add
        self._sgemm = Sgemm.find()

    def empty(self, shape, dtype=np.float32):
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def asarray(self, host):
        return np.ascontiguousarray(host)

    def to_host(self, arr):
        return np.asarray(arr)

    def copy_(self, dst, src):
        np.copyto(dst, src)

    def synchronize(self):
        pass

    def fill_(self, x, value):
        self._arg("fill_", "x", x, dtype=x.dtype).fill(value)
