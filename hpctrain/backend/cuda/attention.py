"""Causal multi-head self-attention on the GPU, the "math" path: batched GEMMs around row kernels.

Shape letters: B batch, T sequence, C channels, H heads of hs = C/H channels; qkv[B·T, 3C] is the fused projection
(q in columns 0..C-1, k in C..2C-1, v in 2C..3C-1, head h in columns h·hs..(h+1)·hs-1 of each), att[B, H, T, T]
the softmax probabilities (0 above the diagonal). q·kᵀ, att·v and the three products of the backward pass are
batched GEMMs over (batch, head) that read q, k, v in place from qkv (gemm/); the causal softmax and its
gradient are row kernels here, one segment of 32 threads (a warp's worth) per row of att[B·H·T, T], 8 rows per
256-thread block, combining through shared memory, the scale and the causal mask fused in. No floating-point
atomics: every result is bit-identical run to run. The fused kernels of model.attention = "flash" are flash.py.

With the cuBLASLt provider (``cuda.gemm``: gemm/__init__.py) the five products are strided-batched cuBLASLt
calls instead, as llm.c's attention does: q, k, v (and in the backward dy) are first copied out of qkv into
contiguous [B·H, T, hs] heads (``attention_heads``; bfloat16 words under ``train.precision = "bf16"``, which is
the products' rounding of them), each product is one call over the B·H heads (the whole T×T: no causal tiles
skipped, the softmax kernels zero what lies above the diagonal), and the heads of the output (y, or dq, dk, dv)
are copied back into rows (``attention_rows``). What cuBLASLt refuses runs in tiled.py's batched kernels on the
same heads (``_strided``).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, uint16

from . import blocks
from .activations import _bf16_bits
from .gemm import NN, NT, TN
from .memory import flat
from .gemm.tiled import MODE_CAUSAL_K_BELOW, MODE_CAUSAL_K_FROM, MODE_CAUSAL_UPPER

__all__ = ["kernels", "Attention"]

_ZERO, _ONE, _NEG_INF = blocks.ZERO, blocks.ONE, blocks.NEG_INF
_SHIFT = np.uint32(16)


@cuda.jit(device=True)
def _row_index(e, part, W, T, H, hs):
    """Where element e of contiguous heads [parts, B·H, T, hs] (``part`` elements a part: B·T·C) sits in the
    flat rows x[B·T, W] it was copied from: row b·T + t, column p·C + h·hs + d (C = H·hs)."""
    p = e // part
    r = e - p * part
    z = r // (T * hs)
    r -= z * T * hs
    t = r // hs
    b = z // H
    return (b * T + t) * W + p * H * hs + (z - b * H) * hs + r - t * hs


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """The softmax row kernels for blocks of ``nt`` threads; compiled lazily, once per process."""
    THREADS, kernel = nt, blocks.kernel_decorator(nt)
    red = blocks.block_reducers(nt)
    segment_sum, segment_max = red.segment_sum, red.segment_max
    W = red.W  # threads per attention row
    R = THREADS // W  # attention rows per block

    @kernel
    def attention_softmax_rows(att, T, scale):
        """att[r, j] = softmax_{j ≤ i}(scale · att[r, j]) in place, 0 for j > i, where i = r % T."""
        sh = cuda.shared.array(THREADS, float32)
        tid = cuda.threadIdx.x
        lane = tid % W
        rows = att.shape[0]
        for r0 in range(cuda.blockIdx.x * R, rows, cuda.gridDim.x * R):  # the same r0 for the whole block
            r = r0 + tid // W
            i = r % T
            n = i + 1 if r < rows else 0  # a thread past the last row still takes part in the reductions
            mx = _NEG_INF
            for j in range(lane, n, W):
                mx = max(mx, att[r, j] * scale)
            mx = segment_max(sh, mx)
            z = _ZERO
            for j in range(lane, n, W):  # each thread reads back only the entries it wrote
                e = math.exp(att[r, j] * scale - mx)
                att[r, j] = e
                z += e
            z = segment_sum(sh, z)
            if r < rows:
                inv = _ONE / z
                for j in range(lane, T, W):
                    att[r, j] = att[r, j] * inv if j <= i else _ZERO

    @kernel
    def attention_softmax_backward_rows(att, dscores, T, scale):
        """dscores[r, j] = scale · att ⊙ (datt − Σ_j att·datt) in place, where dscores holds datt = dy·vᵀ on
        and below the diagonal; 0 for j > i."""
        sh = cuda.shared.array(THREADS, float32)
        tid = cuda.threadIdx.x
        lane = tid % W
        rows = att.shape[0]
        for r0 in range(cuda.blockIdx.x * R, rows, cuda.gridDim.x * R):
            r = r0 + tid // W
            i = r % T
            n = i + 1 if r < rows else 0
            dot = _ZERO
            for j in range(lane, n, W):
                dot += att[r, j] * dscores[r, j]
            dot = segment_sum(sh, dot)
            if r < rows:
                for j in range(lane, T, W):
                    dscores[r, j] = scale * att[r, j] * (dscores[r, j] - dot) if j <= i else _ZERO

    @kernel
    def attention_heads(src, W, dst, T, H, hs, bf16):
        """dst[p, b·H + h, t, d] = src[b·T + t, p·C + h·hs + d] (C = H·hs) for each part p of dst (its size /
        (B·H·T·hs) parts: q, k, v from qkv, or dy alone): heads made contiguous. On float32 bits (src a float32
        [B·T, W] array viewed flat as uint32): dst uint32 (a copy) or, with ``bf16``, uint16 words rounded to
        nearest even (``_bf16_bits``); on bfloat16 words (src and dst uint16, ``bf16`` false): a copy."""
        part = src.size // W * H * hs  # B·T·C: one of q, k, v
        for e in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
            u = src[_row_index(e, part, W, T, H, hs)]
            if bf16:
                dst[e] = uint16(_bf16_bits(u) >> _SHIFT)
            else:
                dst[e] = u

    @kernel
    def attention_rows(src, dst, W, T, H, hs):
        """dst[b·T + t, p·C + h·hs + d] = src[p, b·H + h, t, d]: ``attention_heads``' inverse on float32 (dst a
        float32 [B·T, W] array viewed flat; src's parts fill dst's first parts·C columns)."""
        part = dst.size // W * H * hs
        for e in range(cuda.grid(1), src.size, cuda.gridsize(1)):
            dst[_row_index(e, part, W, T, H, hs)] = src[e]

    return SimpleNamespace(ROWS_PER_BLOCK=R, attention_softmax_rows=attention_softmax_rows,
                           attention_softmax_backward_rows=attention_softmax_backward_rows,
                           attention_heads=attention_heads, attention_rows=attention_rows)


class Attention:
    """CudaBackend's math-path attention (a mixin)."""

    def attention_forward(self, qkv, T, n_head, out, att, *, dropout=None):
        """out[B·T, C] = softmax(q·kᵀ/√hs, causal)·v per head, from qkv[B·T, 3C] (q, k, v, heads of hs = C/H);
        att[B, H, T, T] keeps the probabilities for the backward pass. ``dropout`` (a DropRows over att's
        B·H·T rows): out = dropout(att)·v, att itself kept undropped (the backward redraws the mask)."""
        op = "attention_forward"
        B, H, C, hs, T = self._attention_args(op, qkv, T, n_head, att, out=out)
        if B == 0:
            return
        scale, Z, tile = np.float32(1.0 / math.sqrt(hs)), B * H, self.attention_tile
        att2 = att.reshape(B * H * T, T)  # row (b·H + h)·T + i
        if self._cublaslt is not None:
            self._strided_forward(op, qkv, att2, out, T, H, hs, scale, dropout)
            return
        q, k, v = (T, 0, 0, hs), (T, 0, C, hs), (T, 0, 2 * C, hs)  # a head's [T, hs] in qkv (gemm/tiled.py)
        rows, heads = (H * T, T, 0, 0), (T, 0, 0, hs)  # a head's [T, T] in att2, its [T, hs] in out
        src = self._product_input(op, qkv)
        self._batched(tile, NT, src, src, att2, T, T, hs, hs, H, Z, q, k, rows, MODE_CAUSAL_UPPER)
        self._product_output_(att2)
        self._attention_rows(self._k.attention_softmax_rows, B * H * T, att2, T, scale)
        used = self._product_input(op, self._dropped(op, att2, dropout))
        self._batched(tile, NN, used, src, out, T, hs, T, T, H, Z, rows, v, heads, MODE_CAUSAL_K_BELOW)
        self._product_output_(out)

    def attention_backward(self, dout, qkv, att, T, n_head, dqkv, *, dropout=None):
        """dqkv[B·T, 3C] from dout[B·T, C], the forward's qkv and att (overwritten, never accumulated);
        ``dropout`` as the forward's."""
        op = "attention_backward"
        B, H, C, hs, T = self._attention_args(op, qkv, T, n_head, att, dout=dout, dqkv=dqkv)
        if B == 0:
            return
        scale, Z, tile = np.float32(1.0 / math.sqrt(hs)), B * H, self.attention_tile
        att2 = att.reshape(B * H * T, T)
        if self._cublaslt is not None:
            self._strided_backward(op, dout, qkv, att2, dqkv, T, H, hs, scale, dropout)
            return
        dscores = self._alloc(op, (B * H * T, T), np.float32)
        q, k, v = (T, 0, 0, hs), (T, 0, C, hs), (T, 0, 2 * C, hs)
        rows, dy = (H * T, T, 0, 0), (T, 0, 0, hs)
        src, dsrc = self._product_input(op, qkv), self._product_input(op, dout)
        self._batched(tile, NT, dsrc, src, dscores, T, T, hs, hs, H, Z, dy, v, rows, MODE_CAUSAL_UPPER)  # dy·vᵀ
        self._product_output_(dscores)
        used = self._product_input(op, self._dropped(op, att2, dropout))
        self._batched(tile, TN, used, dsrc, dqkv, T, hs, T, T, H, Z, rows, dy, v, MODE_CAUSAL_K_FROM)  # dv
        if dropout is not None:
            self.dropout(dscores, dscores, dropout)  # the gradient of the dropped att, through the same mask
        self._attention_rows(self._k.attention_softmax_backward_rows, B * H * T, att2, dscores, T, scale)
        self._product_output_(dscores)  # an input of the two products below, needed nowhere else
        self._batched(tile, NN, dscores, src, dqkv, T, hs, T, T, H, Z, rows, k, q, MODE_CAUSAL_K_BELOW)  # dq
        self._batched(tile, TN, dscores, src, dqkv, T, hs, T, T, H, Z, rows, q, k, MODE_CAUSAL_K_FROM)  # dk
        self._product_output_(dqkv)  # dq, dk and dv: three products' outputs, each written once

    # --------------------------------------------------------------- through cuBLASLt: heads made contiguous

    def _strided_forward(self, op, qkv, att2, out, T, H, hs, scale, dropout):
        """``attention_forward`` as strided-batched products over contiguous heads (module docstring)."""
        q, k, v = self._heads(op, qkv, 3, T, H, hs)
        Z = att2.shape[0] // T
        self._strided(NT, q, k, att2, T, T, hs, Z)  # scores, the whole T×T of each head
        self._product_output_(att2)
        self._attention_rows(self._k.attention_softmax_rows, att2.shape[0], att2, T, scale)
        used = self.product_input(self._dropped(op, att2, dropout))
        y = self._alloc(op, (Z * T, hs), np.float32)
        self._strided(NN, used, v, y, T, hs, T, Z)
        self._to_rows(y, out, T, H, hs)
        self._product_output_(out)

    def _strided_backward(self, op, dout, qkv, att2, dqkv, T, H, hs, scale, dropout):
        """``attention_backward`` as strided-batched products over contiguous heads: dq, dk, dv written as the
        three parts of one [3, B·H, T, hs] buffer and copied into dqkv's rows together."""
        q, k, v = self._heads(op, qkv, 3, T, H, hs)
        (dy,) = self._heads(op, dout, 1, T, H, hs)
        Z = att2.shape[0] // T
        dscores = self._alloc(op, att2.shape, np.float32)
        self._strided(NT, dy, v, dscores, T, T, hs, Z)  # datt = dy·vᵀ
        self._product_output_(dscores)
        used = self.product_input(self._dropped(op, att2, dropout))
        grads = self._alloc(op, (3 * Z * T, hs), np.float32)
        dq, dk, dv = (grads[i * Z * T : (i + 1) * Z * T] for i in range(3))
        self._strided(TN, used, dy, dv, T, hs, T, Z)  # dv = attᵀ·dy
        if dropout is not None:
            self.dropout(dscores, dscores, dropout)
        self._attention_rows(self._k.attention_softmax_backward_rows, att2.shape[0], att2, dscores, T, scale)
        self._product_output_(dscores)
        ds = self.product_input(dscores)
        self._strided(NN, ds, k, dq, T, hs, T, Z)  # dq = ds·k
        self._strided(TN, ds, q, dk, T, hs, T, Z)  # dk = dsᵀ·q
        self._to_rows(grads, dqkv, T, H, hs)
        self._product_output_(dqkv)

    def _heads(self, op, x, parts, T, H, hs) -> list:
        """The ``parts`` column blocks of x[B·T, parts·C] as contiguous heads, each [B·H·T, hs]: float32, or
        bfloat16 words where this backend's products take bfloat16 (``bf16_storage``; the copy is their rounding)."""
        rows, W = x.shape
        dtype = np.float32 if self.bf16_storage is None else self.bf16_storage
        heads = self._alloc(op, (parts * rows * H, hs), dtype)
        words = flat(heads).view(np.uint32) if dtype == np.float32 else flat(heads)
        kept = x.dtype == dtype != np.float32  # q, k and v attention kept as bfloat16 words: copied as they are
        self._elementwise(self._k.attention_heads, heads.size, flat(x) if kept else flat(x).view(np.uint32), W,
                          words, T, H, hs, dtype != np.float32 and not kept)
        return [heads[i * rows * H : (i + 1) * rows * H] for i in range(parts)]

    def _to_rows(self, heads, x, T, H, hs) -> None:
        """``_heads``' inverse: float32 heads [parts·B·H·T, hs] into the first parts·C columns of x[B·T, W]."""
        self._elementwise(self._k.attention_rows, heads.size, flat(heads), flat(x), x.shape[1], T, H, hs)

    def _product_input(self, op, x):
        """What a product reads of ``x``: ``x`` itself here; precision.py's bf16 backend gives a copy rounded to
        bfloat16 (``x`` is read again elsewhere in float32)."""
        return x

    def _product_output_(self, x) -> None:
        """After a product wrote ``x``: nothing here; precision.py's bf16 backend rounds it to bfloat16."""

    def _dropped(self, op, att2, dropout):
        """att2, or its dropout into a new array (the mask drawn again in the backward pass)."""
        if dropout is None:
            return att2
        out = self._alloc(op, att2.shape, np.float32)
        self.dropout(att2, out, dropout)
        return out

    def _attention_rows(self, kernel, rows, *args):
        per_block = self._k.ROWS_PER_BLOCK
        self._launch(kernel, self._rows_grid(-(-rows // per_block)), self.block, *args)
