"""Losses on the GPU: softmax cross-entropy (whole rows, and the vocab-parallel shard's three passes) and MSE,
each value and gradient in one pass.

Shape letters: B rows, C classes (V: a shard's block of the vocabulary, columns [lo, lo + V)). Cross-entropy is
one launch: a row kernel (one block per row; max, argmax and Σ exp in one read of the row, the gradient in a
second) whose last block to finish adds the rows' losses, correct counts and first bad target in float64
(blocks.py's ``last_to_finish``); MSE writes float64 partial sums per block that ``CudaBackend._sum_reduce`` adds
(blocks.py's ``sum_partials``). The vocab-parallel passes are cpu/loss.py's ``_ce_shard_*``.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, float64, int64

from . import blocks
from .memory import flat

__all__ = ["kernels", "Loss"]

_ZERO, _ONE, _NEG_INF = blocks.ZERO, blocks.ONE, blocks.NEG_INF


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """The loss kernels for blocks of ``nt`` threads; compiled lazily, once per process."""
    return SimpleNamespace(**vars(_cross_entropy_kernels(nt)), **vars(_shard_and_mse_kernels(nt)))


@functools.cache
def _cross_entropy_kernels(nt: int) -> SimpleNamespace:
    """Whole-row cross-entropy: loss, correct count and gradient in one launch."""
    NT, kernel = nt, blocks.kernel_decorator(nt)
    red = blocks.block_reducers(nt)
    block_sum, argmax_combine = red.block_sum, red.argmax_combine
    last_to_finish = blocks.last_to_finish

    @kernel
    def softmax_cross_entropy(logits, targets, dlogits, grad_scale, row_loss, row_flag, counters, out):
        """Per row of logits[B,C]: row_loss = logsumexp − logit[target] (float64), row_flag = 1 if argmax ==
        target else 0, or −1 for a target outside [0, C); dlogits = (softmax − onehot)·grad_scale. The row's
        max, first argmax and Σ exp come from one read of it (an online softmax: each thread rescales its sum
        when its max grows), the gradient from a second. The last block to finish writes out = [Σ row_loss,
        number correct, first row with a bad target (B if none)], added in a fixed order."""
        sh_max = cuda.shared.array(NT, float32)
        sh_arg = cuda.shared.array(NT, int64)
        sh_sum = cuda.shared.array(NT, float32)
        sh_last = cuda.shared.array(1, int64)
        sh_loss = cuda.shared.array(NT, float64)
        sh_correct = cuda.shared.array(NT, float64)
        sh_bad = cuda.shared.array(NT, int64)
        B, C = logits.shape
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            target = targets[row]
            best = _NEG_INF
            best_j = int64(C)
            acc = float32(0.0)  # Σ exp(v − best) over this thread's columns so far
            for j in range(t, C, NT):
                v = logits[row, j]
                if v > best:
                    acc = acc * math.exp(best - v) + _ONE
                    best = v
                    best_j = j
                elif best > _NEG_INF or v != v:  # exp(−inf − (−inf)) would be NaN; a NaN logit still shows
                    acc += math.exp(v - best)
            mx, arg = argmax_combine(sh_max, sh_arg, best, best_j)  # max and first argmax, as numpy's argmax
            logz = math.log(block_sum(sh_sum, acc * math.exp(best - mx))) + mx
            bad = target < 0 or target >= C
            if t == 0:
                if bad:
                    row_loss[row] = 0.0
                    row_flag[row] = -1
                else:
                    row_loss[row] = float64(logz) - float64(logits[row, target])
                    row_flag[row] = 1 if arg == target else 0
            if not bad:
                for j in range(t, C, NT):
                    p = math.exp(logits[row, j] - logz)
                    if j == target:
                        p -= _ONE
                    dlogits[row, j] = p * grad_scale
        if last_to_finish(sh_last, counters, 0, cuda.gridDim.x):
            loss = float64(0.0)
            correct = float64(0.0)
            first_bad = int64(B)
            for i in range(t, B, NT):
                loss += row_loss[i]
                f = row_flag[i]
                if f == 1:
                    correct += 1.0
                elif f < 0 and i < first_bad:
                    first_bad = i
            loss = block_sum(sh_loss, loss)
            correct = block_sum(sh_correct, correct)
            sh_bad[t] = first_bad
            cuda.syncthreads()
            s = NT // 2
            while s > 0:
                if t < s and sh_bad[t + s] < sh_bad[t]:
                    sh_bad[t] = sh_bad[t + s]
                cuda.syncthreads()
                s //= 2
            if t == 0:
                out[0] = loss
                out[1] = correct
                out[2] = float64(sh_bad[0])

    return SimpleNamespace(softmax_cross_entropy=softmax_cross_entropy)


@functools.cache
def _shard_and_mse_kernels(nt: int) -> SimpleNamespace:
    """The vocab-parallel cross-entropy's three passes over a block of columns [lo, lo + V) (cpu/loss.py:
    ``_ce_shard_*``), and MSE."""
    NT, kernel = nt, blocks.kernel_decorator(nt)
    red = blocks.block_reducers(nt)
    block_sum, row_argmax = red.block_sum, red.row_argmax

    @kernel
    def ce_shard_stats(logits, targets, lo, mx, arg, tlogit):
        """Per row: mx = its max, arg = its first argmax + lo, tlogit = logits[row, target − lo] or 0."""
        sh_max = cuda.shared.array(NT, float32)
        sh_arg = cuda.shared.array(NT, int64)
        B, V = logits.shape
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            best, best_j = row_argmax(sh_max, sh_arg, logits, row)
            if t == 0:
                mx[row] = best
                arg[row] = best_j + lo
                u = targets[row] - lo
                tlogit[row] = logits[row, u] if u >= 0 and u < V else _ZERO

    @kernel
    def ce_shard_sumexp(logits, mx, sumexp):
        """sumexp[row] = Σ_j exp(logits[row, j] − mx[row]) (float32 sums, stored as float64)."""
        sh_sum = cuda.shared.array(NT, float32)
        B, V = logits.shape
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            m = mx[row]
            acc = float32(0.0)
            for j in range(t, V, NT):
                acc += math.exp(logits[row, j] - m)
            total = block_sum(sh_sum, acc)
            if t == 0:
                sumexp[row] = float64(total)

    @kernel
    def ce_shard_grad(logits, targets, lo, logz, dlogits, grad_scale):
        """dlogits = (exp(logits − logz[row]) − onehot(target − lo))·grad_scale, element-wise over the block."""
        B, V = logits.shape
        for i in range(cuda.grid(1), B * V, cuda.gridsize(1)):
            row = i // V
            j = i - row * V
            p = math.exp(logits[row, j] - float32(logz[row]))
            if j == targets[row] - lo:
                p -= _ONE
            dlogits[row, j] = p * grad_scale

    @kernel
    def mse_partial(pred, target, dpred, grad_scale, partial):
        """dpred = 2·(pred − target)·grad_scale over flat [n]; partial[block] = Σ (pred − target)²."""
        sh = cuda.shared.array(NT, float64)
        acc = float64(0.0)
        two_scale = float32(2.0) * grad_scale
        for i in range(cuda.grid(1), pred.size, cuda.gridsize(1)):
            diff = pred[i] - target[i]
            dpred[i] = two_scale * diff
            d64 = float64(diff)
            acc += d64 * d64
        total = block_sum(sh, acc)
        if cuda.threadIdx.x == 0:
            partial[cuda.blockIdx.x] = total

    return SimpleNamespace(ce_shard_stats=ce_shard_stats, ce_shard_sumexp=ce_shard_sumexp, ce_shard_grad=ce_shard_grad,
                           mse_partial=mse_partial)


class Loss:
    """CudaBackend's losses (a mixin): host scalars out, or device scalars with ``into`` (no wait)."""

    def cross_entropy(self, logits, targets, dlogits, grad_scale, *, into=None):
        """Softmax cross-entropy of logits[B,C] against int64 targets[B] (host or device): returns (loss sum,
        correct), or with ``into`` writes [loss sum, correct, first bad row (B if none)] there and returns None
        (no wait); writes dlogits = (softmax − onehot)·grad_scale. A target outside [0, C) raises BackendError
        (host targets: at once; device targets with ``into``: the caller reads the bad row)."""
        B, C = self._cross_entropy_args(logits, targets, dlogits)
        self._into_arg("cross_entropy", into, 3)
        if B == 0:
            if into is not None:
                self.copy_(into, np.zeros(3))
                return None
            return 0.0, 0
        if C == 0:
            self.bad_target(targets, 0, C)
        targets = self._device_ids("cross_entropy", targets, C)
        row_loss = self._alloc("cross_entropy", (B,), np.float64)
        row_flag = self._alloc("cross_entropy", (B,), np.int32)
        self._launch(self._k.softmax_cross_entropy, self._rows_grid(B), self.block, logits, targets, dlogits,
                      np.float32(grad_scale), row_loss, row_flag, self._counter_slots(1),
                      self._scalars if into is None else into)
        if into is not None:
            return None
        total, correct, bad = self._read_scalars()
        if bad < B:
            self.bad_target(targets, int(bad), C)
        return float(total), int(correct)

    def ce_shard_stats(self, logits, targets, mx, arg, tlogit, *, vocab_start, vocab):
        """Vocab-parallel cross-entropy, pass 1 (see the CPU backend): each row's max, first argmax + vocab_start,
        and the target's logit where this block of columns holds it."""
        B, V, lo = self._vocab_shard_args("ce_shard_stats", logits, targets, vocab_start, vocab,
                                          mx=(mx, np.float32), arg=(arg, np.int64), tlogit=(tlogit, np.float32))
        if B and V:
            targets = self._device_ids("ce_shard_stats", targets, None)  # the loss checks them against the vocab
            self._launch(self._k.ce_shard_stats, self._rows_grid(B), self.block, logits, targets, lo, mx, arg, tlogit)

    def ce_shard_sumexp(self, logits, mx, sumexp):
        """Pass 2: sumexp[B] (float64) = Σ_j exp(logits[i, j] − mx[i])."""
        B, _ = self._ce_sumexp_args(logits, mx, sumexp)
        if B:
            self._launch(self._k.ce_shard_sumexp, self._rows_grid(B), self.block, logits, mx, sumexp)

    def ce_shard_grad(self, logits, targets, logz, dlogits, grad_scale, *, vocab_start, vocab):
        """Pass 3: dlogits = (exp(logits − logz) − onehot(target))·grad_scale on this block of columns."""
        B, V, lo = self._vocab_shard_args("ce_shard_grad", logits, targets, vocab_start, vocab,
                                          logz=(logz, np.float64))
        self._arg("ce_shard_grad", "dlogits", dlogits, shape=(B, V))
        targets = self._device_ids("ce_shard_grad", targets, None) if B * V else targets
        self._elementwise(self._k.ce_shard_grad, B * V, logits, targets, lo, logz, dlogits, np.float32(grad_scale))

    def mse(self, pred, target, dpred, grad_scale, *, into=None):
        """Σ (pred − target)² over pred[B,C] (host float, or written to into[0] with no wait); writes
        dpred = 2·(pred − target)·grad_scale."""
        self._mse_args(pred, target, dpred)
        self._into_arg("mse", into, 3)
        return self._sum_reduce("mse", self._k.mse_partial, pred.size, flat(pred), flat(target), flat(dpred),
                                np.float32(grad_scale), into=into)
