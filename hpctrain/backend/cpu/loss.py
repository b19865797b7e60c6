"""Losses on the CPU: softmax cross-entropy (whole rows, and the vocab-parallel shard's three passes) and MSE, each
value and gradient in one pass (``numba.njit``; the sums in float64). Shape letters: B rows, C classes (V: a shard's
block of the vocabulary).
"""

from __future__ import annotations

import math

import numpy as np

from .jit import jit

__all__ = ["Loss"]


@jit
def _cross_entropy(logits, targets, dlogits, grad_scale):
    """Softmax cross-entropy per row; returns (sum of losses, number correct, bad target or -1)."""
    B, C = logits.shape
    total = 0.0
    correct = 0
    for i in range(B):
        t = targets[i]
        if t < 0 or t >= C:
            return total, correct, i
        mx = np.float64(logits[i, 0])
        arg = 0
        for j in range(1, C):
            if logits[i, j] > mx:
                mx = np.float64(logits[i, j])
                arg = j
        z = 0.0
        for j in range(C):
            z += math.exp(logits[i, j] - mx)
        logz = math.log(z) + mx
        total += logz - logits[i, t]
        if arg == t:
            correct += 1
        for j in range(C):
            p = math.exp(logits[i, j] - logz)
            dlogits[i, j] = (p - (1.0 if j == t else 0.0)) * grad_scale
    return total, correct, -1


@jit
def _ce_shard_stats(logits, targets, lo, mx, arg, tlogit):
    """Per row of a block of columns [lo, lo + V): its max, its first argmax (a column of the whole logits) and
    the target's logit when the target is one of its columns (else 0)."""
    B, V = logits.shape
    for i in range(B):
        m = logits[i, 0]
        a = 0
        for j in range(1, V):
            if logits[i, j] > m:
                m = logits[i, j]
                a = j
        mx[i], arg[i] = m, lo + a
        u = targets[i] - lo
        tlogit[i] = logits[i, u] if 0 <= u < V else 0.0


@jit
def _ce_shard_sumexp(logits, mx, sumexp):
    """sumexp[i] = Σ_j exp(logits[i, j] − mx[i]) in float64 (mx: the row's max over every column)."""
    B, V = logits.shape
    for i in range(B):
        m = np.float64(mx[i])
        z = 0.0
        for j in range(V):
            z += math.exp(logits[i, j] - m)
        sumexp[i] = z


@jit
def _ce_shard_grad(logits, targets, lo, logz, dlogits, grad_scale):
    """dlogits = (softmax − onehot)·grad_scale on a block of columns [lo, lo + V), from each row's log Z."""
    B, V = logits.shape
    for i in range(B):
        u = targets[i] - lo
        for j in range(V):
            p = math.exp(logits[i, j] - logz[i])
            dlogits[i, j] = (p - (1.0 if j == u else 0.0)) * grad_scale


@jit
def _mse(pred, target, dpred, grad_scale):
    p, t, d = pred.ravel(), target.ravel(), dpred.ravel()
    total = 0.0
    for i in range(p.size):
        diff = np.float64(p[i]) - t[i]
        total += diff * diff
        d[i] = 2.0 * diff * grad_scale
    return total


class Loss:
    """CpuBackend's losses (a mixin)."""

    def cross_entropy(self, logits, targets, dlogits, grad_scale, *, into=None):
        B, C = self._cross_entropy_args(logits, targets, dlogits)
        self._into_arg("cross_entropy", into, 3)
        total, correct, bad = _cross_entropy(logits, targets, dlogits, float(grad_scale))
        if bad >= 0:
            self.bad_target(targets, bad, C)
        if into is not None:
            into[:] = float(total), int(correct), B
            return None
        return float(total), int(correct)

    def ce_shard_stats(self, logits, targets, mx, arg, tlogit, *, vocab_start, vocab):
        """Vocab-parallel cross-entropy, pass 1, on logits[B, V] holding columns [vocab_start, +V) of ``vocab``:
        mx[B] (float32) each row's max, arg[B] (int64) its first argmax as a column of the whole logits,
        tlogit[B] (float32) the target's logit where this block holds the target, else 0."""
        B, V, lo = self._vocab_shard_args("ce_shard_stats", logits, targets, vocab_start, vocab,
                                          mx=(mx, np.float32), arg=(arg, np.int64), tlogit=(tlogit, np.float32))
        if B and V:
            _ce_shard_stats(logits, targets, lo, mx, arg, tlogit)

    def ce_shard_sumexp(self, logits, mx, sumexp):
        """Pass 2: sumexp[B] (float64) = Σ_j exp(logits[i, j] − mx[i]), mx the max over every rank's columns."""
        self._ce_sumexp_args(logits, mx, sumexp)
        _ce_shard_sumexp(logits, mx, sumexp)

    def ce_shard_grad(self, logits, targets, logz, dlogits, grad_scale, *, vocab_start, vocab):
        """Pass 3: dlogits[B, V] = (exp(logits − logz) − onehot(target))·grad_scale on this block of columns;
        logz[B] (float64) = log Σ over every column, the row's log-partition."""
        B, V, lo = self._vocab_shard_args("ce_shard_grad", logits, targets, vocab_start, vocab,
                                          logz=(logz, np.float64))
        self._arg("ce_shard_grad", "dlogits", dlogits, shape=(B, V))
        _ce_shard_grad(logits, targets, lo, logz, dlogits, float(grad_scale))

    def mse(self, pred, target, dpred, grad_scale, *, into=None):
        self._mse_args(pred, target, dpred)
        self._into_arg("mse", into, 3)
        total = float(_mse(pred, target, dpred, float(grad_scale)))
        if into is None:
            return total
        into[0] = total  # a loss row [sum, correct, bad row] of which mse writes the sum
