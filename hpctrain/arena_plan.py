"""The CUDA step arena's slab, planned without a device: what ``hpctrain plan`` counts on a GPU.

On a GPU a training step's arrays come from one slab that the step arena (backend/arena.py) plans from the
step's own requests: their order, shapes and lifetimes. The slab holds more than the activations a
micro-batch keeps for its backward: every transient of the backward too (the gradients of the MLP's hidden
activations, of the residual stream, the LayerNorms' statistics, attention's scores), placed where the plan's
best-fit finds room, each rounded up to the arena's 512 B. So the plan counts it the arena's own way:

1. one micro-batch's forward, loss and backward run on ``_DeviceShapes``, a backend that computes nothing and
   whose arrays are zero-strided views that know their shape (no memory behind them), and whose ``empty`` goes
   through a ``StepArena`` recording, exactly as the CUDA backend's does;
2. the backend's own transients that ride inside an op are requested where the CUDA backend requests them
   (attention's scores and dropped probabilities, flash attention's row sums, the cross-entropy's per-row
   values, the ids it uploads; under ``train.precision = "bf16"`` the rounded copies each product reads,
   backend/cuda/precision.py); the reductions' partial sums (a few KB, sized by the GPU's multiprocessors)
   are not;
3. the arena plans the record (``plan_offsets``, best-fit over the lifetimes): its slab is one micro-batch's
   step. Each further micro-batch alive at the schedule's peak keeps its saved activations beside it.

The arena is exact by construction on the device; this is a plan of it, as exact as the requests above are
(tests/cuda/test_cuda_arena_plan.py compares it with the slab of a run under the simulator).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from .backend.arena import ALIGN, StepArena

__all__ = ["step_slab_bytes"]


def _array(shape, dtype=np.float32):
    """A zero-strided array of ``shape`` over one element of its own: it takes no memory, and every view of it
    keeps that element (its ``base``) alive, which the arena's reference counts read."""
    return np.broadcast_to(np.zeros((), dtype=dtype), shape)


def _refs(arr):
    return (arr, arr.base)


class _DeviceShapes:
    """A device backend that allocates through a recording step arena and computes nothing."""

    name, is_device = "shapes", True

    def __init__(self, bf16: bool = False, gemm: str = "cublaslt"):
        self.bf16, self.cublaslt = bf16, gemm != "numba"
        self.arena = StepArena(fresh=_array, slab=lambda nbytes: None,
                               carve=lambda slab, offset, shape, dtype: _array(shape, dtype),
                               refs=_refs, root=lambda a: a.base)

    def empty(self, shape, dtype=np.float32):
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        out = self.arena.request(shape, dtype) if math.prod(shape) else None
        return out if out is not None else _array(shape, dtype)

    zeros = empty

    def asarray(self, host):
        return self.empty(np.shape(host), np.asarray(host).dtype) if not _is_ours(host) else host

    upload = asarray

    def to_host(self, arr):
        return np.ones(arr.shape, arr.dtype)  # ones: the vocab-parallel loss takes logarithms of sums

    # the CUDA backend's ops that request arrays of their own (backend/cuda/attention.py, flash.py, loss.py), and
    # under train.precision = "bf16" the copies each product reads (backend/cuda/precision.py, gemm/__init__.py),
    # in its order

    def product_input(self, x):
        return self.empty(x.shape, np.uint16) if self.bf16 and x.dtype != np.uint16 else x

    kept_output = product_input

    def empty_product_input(self, shape):
        return self.empty(shape, np.uint16 if self.bf16 else np.float32)

    @contextlib.contextmanager
    def product_weights(self, data, refresh):
        """bf16: inside a part's passes a weight's held bfloat16 copy (backend/product_weights.py) is what cuBLASLt
        reads, no copy made; tiled.py's kernels still widen it into a float32 one. The copy itself is held across
        steps, outside the arena (``hpctrain plan`` counts it among the parameters)."""
        outer, self._held = self._held, data.base
        try:
            yield
        finally:
            self._held = outer

    _held = None

    def _is_held(self, x) -> bool:
        return self.bf16 and self._held is not None and x.base is self._held

    def _copies(self, *arrays) -> list:
        return [self.empty(a.shape) for a in arrays if a is not None] if self.bf16 else []

    def _operands(self, a, b, bias=None) -> list:
        """The copies a bf16 product makes: each operand as the provider takes it (cuBLASLt: bfloat16, a
        float32 one copied; tiled.py: float32, a float32 one rounded into a copy), the bias rounded, and for
        tiled.py each bfloat16 operand widened."""
        if not self.bf16:
            return []
        made = [self.product_input(x) if self.cublaslt else self.empty(x.shape)
                for x in (a, b) if x.dtype != np.uint16 and not (self.cublaslt and self._is_held(x))]
        made += self._copies(bias)
        if not self.cublaslt:  # a bfloat16 operand widened (a held weight was counted above, rounded or widened)
            made += [self.empty(x.shape) for x in (a, b) if x.dtype == np.uint16]
        return made

    def matmul_nt(self, a, b, out, bias=None):
        self._operands(a, b, bias)  # made and let go within the call

    def matmul_nn(self, a, b, out):
        self._operands(a, b)

    def matmul_tn(self, a, b, out, accumulate=False):
        product = self.empty(out.shape) if self.bf16 and accumulate else None
        copies = self._operands(a, b)
        del product, copies

    def attention_forward(self, qkv, T, n_head, out, att, *, dropout=None):
        scores = (qkv.shape[0] // T * n_head * T, T)
        if self.cublaslt:  # contiguous heads, strided-batched products (backend/cuda/attention.py)
            heads = self._heads(qkv, 3, n_head)
            dropped = self.empty(scores) if dropout is not None else None
            used = self.product_input(_array(scores)) if self.bf16 else None
            y = self.empty((scores[0], qkv.shape[1] // 3 // n_head))
            del heads, dropped, used, y
            return
        src = self._copies(qkv)
        dropped = self.empty(scores) if dropout is not None else None
        used = self._copies(_array(scores))
        del src, dropped, used

    def attention_backward(self, dout, qkv, att, T, n_head, dqkv, *, dropout=None):
        scores = (qkv.shape[0] // T * n_head * T, T)
        if self.cublaslt:
            heads, dy = self._heads(qkv, 3, n_head), self._heads(dout, 1, n_head)
            dscores = self.empty(scores)
            dropped = self.empty(scores) if dropout is not None else None
            used = self.product_input(_array(scores)) if self.bf16 else None
            grads = self.empty((3 * scores[0], qkv.shape[1] // 3 // n_head))
            ds = self.product_input(dscores)
            del heads, dy, dscores, dropped, used, grads, ds
            return
        dscores = self.empty(scores)
        src = self._copies(qkv, dout)
        dropped = self.empty(scores) if dropout is not None else None
        used = self._copies(_array(scores))
        del dscores, src, dropped, used

    def _heads(self, x, parts, n_head):
        """attention.py's ``_heads``: x's column blocks as contiguous heads, bfloat16 words under bf16."""
        rows, width = x.shape
        hs = width // parts // n_head
        return self.empty((parts * rows * n_head, hs), np.uint16 if self.bf16 else np.float32)

    def flash_attention_backward(self, dout, qkv, out, lse, T, n_head, dqkv, *, dropout=None):
        dsum = self.empty((qkv.shape[0] // T * n_head * T,))
        del dsum

    def cross_entropy(self, logits, targets, dlogits, grad_scale, into=None):
        B = logits.shape[0]
        ids = self.upload(targets) if not _is_ours(targets) else None  # host class ids: uploaded here
        row_loss, row_flag = self.empty((B,), np.float64), self.empty((B,), np.int32)
        del ids, row_loss, row_flag

    def embedding_forward(self, idx, wte, wpe, out, **kwargs):
        ids = self.upload(idx) if not _is_ours(idx) else None  # host ids: uploaded here
        del ids

    def embedding_backward(self, dout, idx, dwte, dwpe, **kwargs):
        order = self.empty((3 * math.prod(idx.shape) + 2,), np.int64)  # the rows sorted by id, uploaded
        del order

    def read_host(self, *arrays):
        return tuple(np.zeros(a.shape, a.dtype) for a in arrays)

    def __getattr__(self, name):  # matmul_nt, layernorm_forward, add_, ...: nothing to compute
        return lambda *args, **kwargs: None


def _is_ours(arr) -> bool:
    return isinstance(arr, np.ndarray) and arr.ndim > 0 and not any(arr.strides)


def step_slab_bytes(part, model, loss, mb_samples: int, chunk: int, *, bf16: bool = False,
                    gemm: str = "cublaslt") -> tuple[int, int, int]:
    """(the arena's slab for one micro-batch's forward, loss and backward of ``chunk`` of ``part``, the bytes that
    micro-batch saves for its backward, the bytes it sends to a neighbouring stage), planned as the CUDA backend's
    step arena plans them. A pipeline's received activations and gradients live in its receive rings, outside the
    arena; what it sends is lent to its sender thread, so the arena keeps it to the step's end. ``gemm``: the
    provider of the Linears' products ("numba": tiled.py's kernels, whose bf16 copies are float32; else
    cuBLASLt, as ``cuda.gemm = "auto"`` takes on a GPU with nvmath-python)."""
    from .params import FlatBuffer
    from .parallel.executor import nbytes_of

    be = _DeviceShapes(bf16, gemm)
    buf = FlatBuffer(be, part.layout)
    part.bind(buf, buf)
    width, rows = part.chunk_widths[chunk][0], mb_samples * model.positions
    first, last = part.chunk_is_first(chunk), part.chunk_is_last(chunk)
    with be.arena.step():
        if first:  # as the executor loads them: int64 ids stay on the host
            x = (np.zeros((mb_samples, model.positions), np.int64) if model.positions > 1
                 else be.empty((mb_samples, width)))  # uploaded
        else:
            x = _array((rows, width))  # a receive ring's slot
        y = None
        if last:
            y = (np.zeros(rows, np.int64) if getattr(loss, "target_dtype", np.int64) == np.int64
                 else be.empty((rows, part.chunk_widths[chunk][1])))  # uploaded
        out, saved = part.forward(be, x, chunk=chunk)
        kept = nbytes_of(saved, ALIGN)
        if last:
            _, _, dout = loss(be, out, y, 1.0)
            sent = 0
        else:
            be.arena.lend(out)  # SendActivation
            sent = nbytes_of(out, ALIGN)
            dout = _array(out.shape)  # a receive ring's slot
        del out
        dinp = part.backward(be, dout, saved, need_dinp=not first, chunk=chunk)
        if dinp is not None:
            be.arena.lend(dinp)  # SendGrad
            sent += nbytes_of(dinp, ALIGN)
        del dout, saved, dinp, x, y
    return be.arena.slab_bytes, kept, sent

