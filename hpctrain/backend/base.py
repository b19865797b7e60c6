"""The kernel contract both backends implement, and the argument checks they share.

A backend owns where arrays live (host memory or GPU memory) and runs every
kernel of a training step on them. ``CpuBackend`` (numpy BLAS + numba.njit) and
``CudaBackend`` (numba.cuda) implement the same methods with the same
signatures; layers, losses and optimizers call only these methods, so they run
unchanged on either. Arguments are checked where they enter: a wrong dtype,
a non-contiguous array or a shape that does not fit raises ``BackendError``
naming the op, the argument and the shapes, never a silent wrong result.
"""

from __future__ import annotations

import numpy as np

from ..errors import BackendError

__all__ = ["Backend", "check_array"]


def check_array(op, name, arr, *, ndim=None, shape=None, rows=None, cols=None, dtype=np.float32):
    """Raise BackendError unless ``arr`` is a C-contiguous ``dtype`` array of the given shape."""
    arr_shape = getattr(arr, "shape", None)
    arr_dtype = getattr(arr, "dtype", None)
    if arr_shape is None or arr_dtype is None:
        raise BackendError(f"{op}: {name} must be an array, got {type(arr).__name__}")
    if np.dtype(arr_dtype) != np.dtype(dtype):
        raise BackendError(f"{op}: {name} must be {np.dtype(dtype).name}, got {np.dtype(arr_dtype).name} with shape {tuple(arr_shape)}")
    if not _is_c_contiguous(arr):
        raise BackendError(f"{op}: {name} must be C-contiguous (shape {tuple(arr_shape)})")
    if ndim is not None and len(arr_shape) != ndim:
        raise BackendError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(arr_shape)}")
    if shape is not None and tuple(arr_shape) != tuple(shape):
        raise BackendError(f"{op}: {name} has shape {tuple(arr_shape)}, expected {tuple(shape)}")
    if rows is not None and arr_shape[0] != rows:
        raise BackendError(f"{op}: {name} has shape {tuple(arr_shape)}, expected {rows} rows")
    if cols is not None and arr_shape[1] != cols:
        raise BackendError(f"{op}: {name} has shape {tuple(arr_shape)}, expected {cols} columns")
    return arr


def _is_c_contiguous(arr) -> bool:
    flags = getattr(arr, "flags", None)
    if flags is None:
        return True
    try:
        return bool(flags["C_CONTIGUOUS"])
    except (KeyError, TypeError):
        return bool(getattr(flags, "c_contiguous", True))


class Backend:
    """Base of CpuBackend and CudaBackend: shared checks; see cpu.py for the kernel list.

    Memory: ``empty``, ``zeros``, ``asarray`` (host -> backend), ``to_host``,
    ``copy_``, ``synchronize``. Products: ``matmul_nt`` (X·Wᵀ + b),
    ``matmul_nn`` (dY·W), ``matmul_tn`` (dYᵀ·X), ``bias_grad``. Element-wise:
    ``relu/gelu/tanh_forward/backward``, ``add_`` (residuals). ``layernorm_forward/backward``.
    Transformer: ``embedding_forward/backward`` (token + position tables, a deterministic
    scatter-add), ``attention_forward/backward`` (causal multi-head attention on a fused
    q/k/v projection).
    Losses return host scalars: ``cross_entropy`` -> (loss sum, correct),
    ``mse`` -> loss sum. Flat buffers: ``sum_squares``, ``scale_``, ``fill_``,
    ``sgd_update``, ``adam_update``. Device backends also stage gradients for an MPI that
    is not CUDA-aware: ``pinned_host(shape)``, ``to_host_into(dev, host)``,
    ``from_host_into(host, dev)``.
    """

    name = "base"
    is_device = False

    def _check_same(self, op, **arrays):
        first_name, first = next(iter(arrays.items()))
        shape = check_array(op, first_name, first).shape
        for name, arr in arrays.items():
            check_array(op, name, arr, shape=shape)

    def _check_flat(self, op, **arrays):
        first_name, first = next(iter(arrays.items()))
        n = check_array(op, first_name, first, ndim=1).shape[0]
        for name, arr in arrays.items():
            check_array(op, name, arr, shape=(n,))

    def _attention_shapes(self, op, qkv, T, n_head):
        """(B, H, C, hs) of a fused qkv[B·T, 3C] with ``n_head`` heads; BackendError if they do not fit."""
        rows, width = check_array(op, "qkv", qkv, ndim=2).shape
        T, H = int(T), int(n_head)
        if T < 1 or rows % T:
            raise BackendError(f"{op}: qkv has {rows} rows, not a multiple of T = {T}")
        if width % 3 or (width // 3) % H:
            raise BackendError(f"{op}: qkv has {width} columns; expected 3·C with C divisible by n_head = {H}")
        C = width // 3
        if C == 0:
            raise BackendError(f"{op}: qkv has no columns")
        return rows // T, H, C, C // H

    def bad_token(self, idx, position, vocab, op="embedding_forward"):
        value = int(self.to_host(idx).reshape(-1)[position])
        raise BackendError(f"{op}: token id {value} at position {position} of the batch is outside "
                           f"[0, {vocab})")

    def bad_target(self, targets, row, classes):
        value = int(self.to_host(targets)[row])
        raise BackendError(f"cross_entropy: target {value} in row {row} is outside [0, {classes})")
