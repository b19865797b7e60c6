"""Losses: the value and its gradient in one kernel call.

Both are means over the global batch, as torch's ``reduction="mean"``: the
kernels return the *sum* over the rows they see and scale the gradient by
``grad_scale`` (1 / global batch for cross-entropy, 1 / (global batch · C) for
MSE), so ranks and micro-batches add up to the single-process gradient.
"""

from __future__ import annotations

import numpy as np

from ..errors import DataError

__all__ = ["CrossEntropyLoss", "MSELoss", "make_loss"]


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

    def __call__(self, be, logits, targets, grad_scale):
        """Return (loss sum, correct count, dlogits)."""
        dlogits = be.empty(logits.shape)
        total, correct = be.cross_entropy(logits, targets, dlogits, grad_scale)
        return total, correct, dlogits


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

    def __call__(self, be, pred, targets, grad_scale):
        dpred = be.empty(pred.shape)
        total = be.mse(pred, targets, dpred, grad_scale)
        return total, 0, dpred


def make_loss(name):
    return {"cross_entropy": CrossEntropyLoss, "mse": MSELoss}[name]()
