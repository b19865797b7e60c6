"""The CPU backend's transformer kernels: token + position embedding, causal multi-head attention.

``CpuBackend`` (cpu.py) takes these methods from ``TransformerKernels``; the contract is
in base.py and the CUDA twins in cuda_transformer.py. Shape letters: B batch, T positions,
C width, V vocabulary, H heads of hs = C/H. Batched products go to numpy's BLAS one
(batch, head) at a time; loops are ``numba.njit``, cached on disk, and the softmax's exp
is numpy's SIMD one. The embedding's backward is one sequential pass in token order:
deterministic.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["TransformerKernels"]

# as in cpu.py: numpy's error model lets LLVM vectorise; reductions may reassociate their sums
_jit = numba.njit(cache=True, nogil=True, error_model="numpy")
_jit_reduce = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})


# --------------------------------------------------------------------------- embedding (token + position)


@_jit
def _embedding_forward(idx, wte, wpe, out, lo, vocab, add_positions):
    """out[b·T + t] = wte[idx[b, t] − lo] + wpe[t]; returns the flat position of the first id outside [0, vocab),
    or -1. An id outside the table's block [lo, lo + V) (a vocab-parallel shard) takes a zero row; without
    ``add_positions`` no wpe row is added (another tensor-parallel rank adds it)."""
    B, T = idx.shape
    V, C = wte.shape
    for b in range(B):
        for t in range(T):
            v = idx[b, t]
            if v < 0 or v >= vocab:
                return b * T + t
            r = b * T + t
            u = v - lo
            if 0 <= u < V:
                for c in range(C):
                    out[r, c] = wte[u, c] + wpe[t, c] if add_positions else wte[u, c]
            else:
                for c in range(C):
                    out[r, c] = wpe[t, c] if add_positions else 0.0
    return -1


@_jit
def _embedding_backward(dout, idx, dwte, dwpe, lo, vocab, accumulate_wte, accumulate_wpe):
    """Scatter-add of dout's rows into dwte by token id (the ids of its block [lo, lo + V) only), summed over
    the batch into dwpe; one fixed order."""
    B, T = idx.shape
    V, C = dwte.shape
    for b in range(B):
        for t in range(T):
            if idx[b, t] < 0 or idx[b, t] >= vocab:
                return b * T + t
    if not accumulate_wte:
        dwte[:] = 0.0
    if not accumulate_wpe:
        dwpe[:] = 0.0
    for b in range(B):
        for t in range(T):
            u = idx[b, t] - lo
            r = b * T + t
            if 0 <= u < V:
                for c in range(C):
                    dwte[u, c] += dout[r, c]
            for c in range(C):
                dwpe[t, c] += dout[r, c]
    return -1


# --------------------------------------------------------------------------- causal attention


@_jit_reduce
def _causal_shift(scores, scale, att):
    """att[..., i, j] = scale · (scores[..., i, j] − max_{j'≤i} scores[..., i, j']) for j ≤ i, −inf above."""
    N, T, _ = scores.shape
    for n in range(N):
        for i in range(T):
            mx = scores[n, i, 0]
            for j in range(1, i + 1):
                mx = max(mx, scores[n, i, j])
            for j in range(i + 1):
                att[n, i, j] = (scores[n, i, j] - mx) * scale
            for j in range(i + 1, T):
                att[n, i, j] = -np.inf


@_jit_reduce
def _normalise_rows(att):
    """Divide each row (of exponentials, zero above the diagonal) by its sum."""
    N, T, _ = att.shape
    for n in range(N):
        for i in range(T):
            z = 0.0
            for j in range(i + 1):
                z += att[n, i, j]
            inv = np.float32(1.0 / z)
            for j in range(i + 1):
                att[n, i, j] *= inv


def _causal_softmax(scores, scale, att):
    """att[..., i, j] = softmax_j≤i(scale · scores[..., i, j]), 0 above the diagonal; the exp is numpy's SIMD one."""
    _causal_shift(scores, np.float32(scale), att)
    np.exp(att, out=att)
    _normalise_rows(att)


@_jit
def _causal_softmax_backward(att, datt, scale, dscores):
    """dscores = scale · att ⊙ (datt − Σ_j att·datt), in place of nothing: a separate output."""
    N, T, _ = att.shape
    for n in range(N):
        for i in range(T):
            dot = 0.0
            for j in range(i + 1):
                dot += np.float64(att[n, i, j]) * datt[n, i, j]
            for j in range(i + 1):
                dscores[n, i, j] = scale * att[n, i, j] * (datt[n, i, j] - dot)
            for j in range(i + 1, T):
                dscores[n, i, j] = 0.0


def _heads(qkv, B, T, H, hs):
    """Views (B, H, T, hs) of the q, k and v parts of qkv[B·T, 3C] (no copies)."""
    five = qkv.reshape(B, T, 3, H, hs)
    return tuple(five[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


class TransformerKernels:
    """Embedding and attention methods of ``CpuBackend`` (host numpy arrays)."""

    # -- embedding: token and learned position
    def embedding_forward(self, idx, wte, wpe, out, *, vocab_start=0, vocab=None, add_positions=True):
        """out[B·T, C] = wte[idx[b, t]] + wpe[t] for token ids idx[B, T] (int64), wte[V, C], wpe[≥T, C].
        A vocab-parallel shard: wte holds ids [vocab_start, vocab_start + V) of ``vocab``, other ids take a
        zero row; ``add_positions = False`` leaves wpe out (base.py: ``_embedding_args``)."""
        B, T, V, C, lo, vocab = self._embedding_args("embedding_forward", idx, wte, wpe, out, "out",
                                                     vocab_start, vocab)
        bad = _embedding_forward(idx, wte, wpe, out, lo, vocab, bool(add_positions))
        if bad >= 0:
            self.bad_token(idx, bad, vocab, op="embedding_forward")

    def embedding_backward(self, dout, idx, dwte, dwpe, *, vocab_start=0, vocab=None, accumulate_wte=False,
                           accumulate_wpe=False):
        """dwte[v − vocab_start] (+)= Σ dout rows with id v (ids of dwte's block); dwpe[t] (+)= Σ_b dout[b·T + t]
        (rows ≥ T of dwpe: 0 or kept)."""
        B, T, V, C, lo, vocab = self._embedding_args("embedding_backward", idx, dwte, dwpe, dout, "dout",
                                                     vocab_start, vocab)
        bad = _embedding_backward(dout, idx, dwte, dwpe, lo, vocab, bool(accumulate_wte), bool(accumulate_wpe))
        if bad >= 0:
            self.bad_token(idx, bad, vocab, op="embedding_backward")

    # -- causal multi-head self-attention on the fused q, k, v projection
    def attention_forward(self, qkv, T, n_head, out, att, *, dropout=None):
        """out[B·T, C] = softmax(q·kᵀ/√hs, causal)·v per head, from qkv[B·T, 3C] (q, k, v, heads of hs = C/H);
        att[B, H, T, T] keeps the probabilities for the backward pass. ``dropout`` (a DropRows over att's
        B·H·T rows): out = dropout(att)·v, att itself kept undropped (the backward redraws the mask)."""
        B, H, C, hs, T = self._attention_args("attention_forward", qkv, T, n_head, att, out=out)
        q, k, v = _heads(qkv, B, T, H, hs)
        scores = np.matmul(q, k.transpose(0, 1, 3, 2))  # (B, H, T, T), BLAS per head
        _causal_softmax(scores.reshape(B * H, T, T), 1.0 / math.sqrt(hs), att.reshape(B * H, T, T))
        np.matmul(self._dropped(att, dropout, scores), v, out=out.reshape(B, T, H, hs).transpose(0, 2, 1, 3))

    def attention_backward(self, dout, qkv, att, T, n_head, dqkv, *, dropout=None):
        """dqkv[B·T, 3C] from dout[B·T, C], the forward's qkv and att (overwritten, never accumulated);
        ``dropout`` as the forward's."""
        B, H, C, hs, T = self._attention_args("attention_backward", qkv, T, n_head, att, dout=dout, dqkv=dqkv)
        q, k, v = _heads(qkv, B, T, H, hs)
        dq, dk, dv = _heads(dqkv, B, T, H, hs)
        dy = dout.reshape(B, T, H, hs).transpose(0, 2, 1, 3)
        datt = np.matmul(dy, v.transpose(0, 1, 3, 2))  # (B, H, T, T): the gradient of the dropped att
        dscores = np.empty_like(datt)
        np.matmul(self._dropped(att, dropout, dscores).transpose(0, 1, 3, 2), dy, out=dv)
        if dropout is not None:
            self.dropout(datt.reshape(-1, T), datt.reshape(-1, T), dropout)  # through the same mask
        _causal_softmax_backward(att.reshape(B * H, T, T), datt.reshape(B * H, T, T), 1.0 / math.sqrt(hs),
                                 dscores.reshape(B * H, T, T))
        np.matmul(dscores, k, out=dq)
        np.matmul(dscores.transpose(0, 1, 3, 2), q, out=dk)

    def _dropped(self, att, dropout, scratch):
        """att, or its dropout into ``scratch`` (an array of att's shape free for it)."""
        if dropout is None:
            return att
        T = att.shape[-1]
        self.dropout(att.reshape(-1, T), scratch.reshape(-1, T), dropout)
        return scratch
