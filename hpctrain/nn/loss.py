"""Losses: the value and its gradient in one kernel call.

Both are means over the global batch, as torch's ``reduction="mean"``: the
kernels return the *sum* over the rows they see and scale the gradient by
``grad_scale`` (1 / global batch for cross-entropy, 1 / (global batch · C) for
MSE), so ranks and micro-batches add up to the single-process gradient.

Called as ``loss(be, out, targets, grad_scale, into=row)``: with ``into`` (a float64 backend
array of 3, the micro-batch's loss row) the sums stay on the backend and the call returns
(None, None, dout), so a device need not wait for them; the step reads every row at once
(parallel/executor.py). A loss that must see its sums on the host (the vocab-parallel one,
which reduces them over its group) returns them as values and leaves ``into`` alone.
"""

from __future__ import annotations

import numpy as np

from ..errors import DataError

__all__ = ["CrossEntropyLoss", "MSELoss", "VocabParallelCrossEntropy", "make_loss"]


class CrossEntropyLoss:
    """Softmax cross-entropy on logits[B,C] with int64 class targets[B]."""

    name = "cross_entropy"
    target_dtype = np.int64
    classification = True

    def check_targets(self, shape, dtype, out_features, where):
        if len(shape) != 1:
            raise DataError(f"{where}: cross_entropy needs class indices of shape (N,), got shape {tuple(shape)}")
        if not np.issubdtype(dtype, np.integer):
            raise DataError(f"{where}: cross_entropy needs integer class indices, got dtype {np.dtype(dtype).name}")

    def grad_scale(self, global_batch, out_features):
        return 1.0 / global_batch

    def __call__(self, be, logits, targets, grad_scale, into=None):
        """Return (loss sum, correct count, dlogits); (None, None, dlogits) with the sums written ``into``."""
        dlogits = be.empty(logits.shape)
        sums = be.cross_entropy(logits, targets, dlogits, grad_scale, into=into)
        return (None, None, dlogits) if sums is None else (*sums, dlogits)


class MSELoss:
    """Mean squared error over every element of pred[B,C] against float targets[B,C]."""

    name = "mse"
    target_dtype = np.float32
    classification = False

    def check_targets(self, shape, dtype, out_features, where):
        ok = (len(shape) == 2 and shape[1] == out_features) or (len(shape) == 1 and out_features == 1)
        if not ok:
            raise DataError(f"{where}: mse needs targets of shape (N, {out_features}) to match the model output, "
                            f"got shape {tuple(shape)}")
        if not np.issubdtype(dtype, np.floating) and not np.issubdtype(dtype, np.integer):
            raise DataError(f"{where}: mse needs numeric targets, got dtype {np.dtype(dtype).name}")

    def grad_scale(self, global_batch, out_features):
        return 1.0 / (global_batch * out_features)

    def __call__(self, be, pred, targets, grad_scale, into=None):
        dpred = be.empty(pred.shape)
        total = be.mse(pred, targets, dpred, grad_scale, into=into)
        return (None, None, dpred) if total is None else (total, 0, dpred)


class VocabParallelCrossEntropy(CrossEntropyLoss):
    """Cross-entropy over logits whose vocabulary columns are split over a tensor-parallel group (Megatron's
    ``vocab_parallel_cross_entropy``): this rank holds columns [lo, lo + V) of ``vocab``, and the [rows, vocab]
    logits never exist whole on one rank.

    Three passes over the rank's block (backend ``ce_shard_*``) and three Allreduces of one value per row:
    the row max (MAX), then the sum of exp(logit − max) with the target's logit (SUM: only the rank holding the
    target gives it), and the first argmax for the correct count (MIN over the ranks that reach the max). The
    loss sum and correct count come out the same on every rank of the group; dlogits is this block's.
    Collective over ``tp``: every rank of the group calls it for the same rows, in the same order.
    """

    def __init__(self, tp, lo: int, vocab: int):
        self.tp, self.lo, self.vocab = tp, int(lo), int(vocab)

    def __call__(self, be, logits, targets, grad_scale, into=None):
        """Return (loss sum, correct count, dlogits) as host values: they are reduced over the group here."""
        from mpi4py import MPI

        B, V = logits.shape
        if B == 0:
            return 0.0, 0, be.empty(logits.shape)
        host_targets = be.to_host(targets)  # the step's targets are host arrays: no wait
        bad = np.flatnonzero((host_targets < 0) | (host_targets >= self.vocab))
        if bad.size:  # the same targets on every rank of the group: all of them stop here, with this error
            be.bad_target(targets, int(bad[0]), self.vocab)
        mx, arg, tlogit = be.empty((B,)), be.empty((B,), np.int64), be.empty((B,))
        targets = be.upload(targets)  # uploaded once (staged) for both passes that read them
        be.ce_shard_stats(logits, targets, mx, arg, tlogit, vocab_start=self.lo, vocab=self.vocab)
        local_max, arg, tlogit = be.read_host(mx, arg, tlogit)  # one wait
        row_max = self.tp.allreduce_host(local_max.copy(), MPI.MAX)
        sumexp = be.empty((B,), np.float64)
        be.ce_shard_sumexp(logits, be.asarray(row_max), sumexp)
        sums = np.concatenate([be.to_host(sumexp), tlogit.astype(np.float64)])
        sums = self.tp.allreduce_host(sums, MPI.SUM)  # Σ exp over every column; the target's logit
        logz = np.log(sums[:B]) + row_max.astype(np.float64)
        first = np.where(local_max == row_max, arg, np.int64(self.vocab))  # ties: the lowest column, as argmax
        first = self.tp.allreduce_host(first, MPI.MIN)
        dlogits = be.empty(logits.shape)
        be.ce_shard_grad(logits, targets, be.asarray(logz), dlogits, grad_scale, vocab_start=self.lo,
                         vocab=self.vocab)
        total = float(np.sum(logz - sums[B:]))
        return total, int(np.count_nonzero(first == host_targets)), dlogits


def make_loss(name, vocab_shard=None):
    """The loss ``train.loss`` names; ``vocab_shard`` = (tp, lo, vocab) when the last layer's output columns are
    this rank's block of a vocab-parallel head (nn/gpt.py: ``VocabParallelHead``)."""
    if vocab_shard is not None and name == "cross_entropy":
        return VocabParallelCrossEntropy(*vocab_shard)
    return {"cross_entropy": CrossEntropyLoss, "mse": MSELoss}[name]()
