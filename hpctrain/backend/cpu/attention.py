"""Causal multi-head self-attention on the CPU: the math path (att[B, H, T, T] kept for the backward pass) and
the flash path (model.attention = "flash": a few heads of one sample at a time, lse kept instead of att).

Shape letters: B batch, T positions, C width, H heads of hs = C/H; qkv[B·T, 3C] the fused projection. Batched
products go to numpy's BLAS one (batch, head) at a time; loops are ``numba.njit``, cached on disk, and the
softmax's exp is numpy's SIMD one. The CUDA twins are cuda/attention.py and cuda/flash.py.
"""

from __future__ import annotations

import math

import numpy as np

from .jit import jit, jit_reduce

__all__ = ["Attention", "heads_at_once", "FLASH_SCRATCH"]


@jit_reduce
def _causal_shift(scores, scale, att, shift):
    """att[..., i, j] = scale · scores[..., i, j] − shift[..., i] for j ≤ i, −inf above, where shift is the row's
    scaled maximum."""
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
            shift[n, i] = mx * scale


@jit_reduce
def _normalise_rows(att, lse):
    """Divide each row (of exponentials, zero above the diagonal) by its sum; lse[..., i] += log of the sum."""
    N, T, _ = att.shape
    for n in range(N):
        for i in range(T):
            z = 0.0
            for j in range(i + 1):
                z += att[n, i, j]
            inv = np.float32(1.0 / z)
            for j in range(i + 1):
                att[n, i, j] *= inv
            lse[n, i] += np.log(z)


def _causal_softmax(scores, scale, att, lse=None):
    """att[..., i, j] = softmax_j≤i(scale · scores[..., i, j]), 0 above the diagonal; the exp is numpy's SIMD one.
    ``lse`` (N, T), if given, receives each row's log Σ_j exp(scale · scores[i, j])."""
    lse = np.empty(scores.shape[:2], np.float32) if lse is None else lse
    _causal_shift(scores, np.float32(scale), att, lse)
    np.exp(att, out=att)
    _normalise_rows(att, lse)


@jit
def _causal_log_probabilities(scores, scale, lse, att):
    """att[..., i, j] = scale · scores[..., i, j] − lse[..., i] for j ≤ i, −inf above (exp: the probabilities)."""
    N, T, _ = scores.shape
    for n in range(N):
        for i in range(T):
            for j in range(i + 1):
                att[n, i, j] = scores[n, i, j] * scale - lse[n, i]
            for j in range(i + 1, T):
                att[n, i, j] = -np.inf


@jit
def _causal_softmax_backward(att, datt, scale, dscores):
    """dscores = scale · att ⊙ (datt − Σ_j att·datt); dscores may be datt (each row's sum is taken before the
    row is written)."""
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


FLASH_SCRATCH = 8 << 20  # bytes of each [heads, T, T] scratch array of the flash path


def heads_at_once(H: int, T: int) -> int:
    """How many heads of one sample the flash path takes at a time."""
    return max(1, min(H, FLASH_SCRATCH // (4 * T * T)))


def _head_chunks(B: int, H: int, T: int):
    """(b, h0, h1): the flash path's chunks, heads [h0, h1) of sample b."""
    n = heads_at_once(H, T)
    return ((b, h0, min(H, h0 + n)) for b in range(B) for h0 in range(0, H, n))


def _chunk_draw(dropout, b: int, h0: int, H: int, T: int):
    """The draw over heads [h0, ..) of sample b's att rows, as its own (heads·T, T) array (None: no dropout)."""
    return None if dropout is None else dropout.from_row((b * H + h0) * T)


def _heads(qkv, B, T, H, hs):
    """Views (B, H, T, hs) of the q, k and v parts of qkv[B·T, 3C] (no copies)."""
    five = qkv.reshape(B, T, 3, H, hs)
    return tuple(five[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


class Attention:
    """CpuBackend's attention, math and flash paths (a mixin). Every product goes through ``_bmm`` (numpy's
    ``matmul``; precision.py's bf16 backend rounds its inputs and output there)."""

    @staticmethod
    def _bmm(a, b, out=None):
        return np.matmul(a, b, out=out)

    def attention_forward(self, qkv, T, n_head, out, att, *, dropout=None):
        """out[B·T, C] = softmax(q·kᵀ/√hs, causal)·v per head, from qkv[B·T, 3C] (q, k, v, heads of hs = C/H);
        att[B, H, T, T] keeps the probabilities for the backward pass. ``dropout`` (a DropRows over att's
        B·H·T rows): out = dropout(att)·v, att itself kept undropped (the backward redraws the mask)."""
        B, H, C, hs, T = self._attention_args("attention_forward", qkv, T, n_head, att, out=out)
        q, k, v = _heads(qkv, B, T, H, hs)
        scores = self._bmm(q, k.transpose(0, 1, 3, 2))  # (B, H, T, T), BLAS per head
        _causal_softmax(scores.reshape(B * H, T, T), 1.0 / math.sqrt(hs), att.reshape(B * H, T, T))
        self._bmm(self._dropped(att, dropout, scores), v, out=out.reshape(B, T, H, hs).transpose(0, 2, 1, 3))

    def attention_backward(self, dout, qkv, att, T, n_head, dqkv, *, dropout=None):
        """dqkv[B·T, 3C] from dout[B·T, C], the forward's qkv and att (overwritten, never accumulated);
        ``dropout`` as the forward's."""
        B, H, C, hs, T = self._attention_args("attention_backward", qkv, T, n_head, att, dout=dout, dqkv=dqkv)
        q, k, v = _heads(qkv, B, T, H, hs)
        dq, dk, dv = _heads(dqkv, B, T, H, hs)
        dy = dout.reshape(B, T, H, hs).transpose(0, 2, 1, 3)
        datt = self._bmm(dy, v.transpose(0, 1, 3, 2))  # (B, H, T, T): the gradient of the dropped att
        dscores = np.empty_like(datt)
        self._bmm(self._dropped(att, dropout, dscores).transpose(0, 1, 3, 2), dy, out=dv)
        if dropout is not None:
            self.dropout(datt.reshape(-1, T), datt.reshape(-1, T), dropout)  # through the same mask
        _causal_softmax_backward(att.reshape(B * H, T, T), datt.reshape(B * H, T, T), 1.0 / math.sqrt(hs),
                                 dscores.reshape(B * H, T, T))
        self._bmm(dscores, k, out=dq)
        self._bmm(dscores.transpose(0, 1, 3, 2), q, out=dk)

    def flash_attention_forward(self, qkv, T, n_head, out, lse, *, dropout=None):
        """out as ``attention_forward``'s, keeping lse[B, H, T] (each row's log Σ_j exp(q·k_j/√hs)) instead of the
        probabilities: a few heads of one sample at a time (at most ``FLASH_SCRATCH`` bytes of [T, T] each), so
        a step holds no [B, H, T, T] array; ``dropout`` as ``attention_forward``'s."""
        B, H, C, hs, T = self._flash_args("flash_attention_forward", qkv, T, n_head, lse, out=out)
        q, k, v = _heads(qkv, B, T, H, hs)
        o = out.reshape(B, T, H, hs).transpose(0, 2, 1, 3)
        scores, att = (np.empty((heads_at_once(H, T), T, T), np.float32) for _ in range(2))
        for b, h0, h1 in _head_chunks(B, H, T):
            s, a = scores[: h1 - h0], att[: h1 - h0]
            self._bmm(q[b, h0:h1], k[b, h0:h1].transpose(0, 2, 1), out=s)
            _causal_softmax(s, 1.0 / math.sqrt(hs), a, lse[b, h0:h1])
            self._bmm(self._dropped(a, _chunk_draw(dropout, b, h0, H, T), s), v[b, h0:h1], out=o[b, h0:h1])

    def flash_attention_backward(self, dout, qkv, out, lse, T, n_head, dqkv, *, dropout=None):
        """dqkv[B·T, 3C] from dout, the forward's qkv, out and lse: the probabilities recomputed a few heads at a
        time from q·kᵀ and lse; overwritten, never accumulated."""
        B, H, C, hs, T = self._flash_args("flash_attention_backward", qkv, T, n_head, lse, out=out, dout=dout,
                                          dqkv=dqkv)
        q, k, v = _heads(qkv, B, T, H, hs)
        dq, dk, dv = _heads(dqkv, B, T, H, hs)
        dy = dout.reshape(B, T, H, hs).transpose(0, 2, 1, 3)
        scale = 1.0 / math.sqrt(hs)
        n = heads_at_once(H, T)
        scores, att = (np.empty((n, T, T), np.float32) for _ in range(2))
        spare = np.empty((n, T, T), np.float32) if dropout is not None else None
        for b, h0, h1 in _head_chunks(B, H, T):
            g = h1 - h0
            s, a = scores[:g], att[:g]
            self._bmm(q[b, h0:h1], k[b, h0:h1].transpose(0, 2, 1), out=s)
            _causal_log_probabilities(s, np.float32(scale), lse[b, h0:h1], a)
            np.exp(a, out=a)
            draw = _chunk_draw(dropout, b, h0, H, T)
            self._bmm(self._dropped(a, draw, None if spare is None else spare[:g]).transpose(0, 2, 1), dy[b, h0:h1],
                      out=dv[b, h0:h1])
            self._bmm(dy[b, h0:h1], v[b, h0:h1].transpose(0, 2, 1), out=s)  # datt, of the dropped att
            if draw is not None:
                self.dropout(s.reshape(-1, T), s.reshape(-1, T), draw)
            _causal_softmax_backward(a, s, scale, s)  # in place: each row's sum is taken before it is written
            self._bmm(s, k[b, h0:h1], out=dq[b, h0:h1])
            self._bmm(s.transpose(0, 2, 1), q[b, h0:h1], out=dk[b, h0:h1])

    def _dropped(self, att, dropout, scratch):
        """att, or its dropout into ``scratch`` (an array of att's shape free for it)."""
        if dropout is None:
            return att
        T = att.shape[-1]
        self.dropout(att.reshape(-1, T), scratch.reshape(-1, T), dropout)
        return scratch
