"""Dropout on the CPU: dropout_mask.py's counter-based draw, bit for bit, fused with the 1/(1 − p) scale. The
same call on the gradient is the backward pass (the mask is drawn again from the element indices).
"""

from __future__ import annotations

import numpy as np

from ..dropout_mask import GOLDEN, MUL1, MUL2, keep_scale, threshold
from .jit import jit

__all__ = ["Dropout"]

_GOLDEN, _MUL1, _MUL2 = np.uint64(GOLDEN), np.uint64(MUL1), np.uint64(MUL2)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_ONE64, _LOW32, _S5 = np.uint64(1), np.uint64(0xFFFFFFFF), np.uint64(5)


@jit
def _dropout(x, out, key, cut, scale, row0, group, stride, causal):
    """out[r, c] = x[r, c] · (scale if the draw of index = global row · W + c is >= cut else 0): one mix64 of
    key ^ (index >> 1) for two neighbouring indices, the even one's draw its high 32 bits, the odd one's the low
    (dropout_mask.py); causal: out = 0 for c > r mod W, nothing drawn."""
    R, W = x.shape
    zero = np.float32(0.0)
    factor = np.empty(W, np.float32)  # a row's factors first: that loop, free of x and out (which may be one
    for r in range(R):                # array), has no branch and vectorises, 3-4x faster than one loop
        base = np.uint64(row0 + (r // group) * stride + r % group) * np.uint64(W)
        n = r % W + 1 if causal else W
        for c in range(n):  # each element hashes its pair again, so that no iteration depends on another
            index = base + np.uint64(c)
            z = (key ^ (index >> _ONE64)) + _GOLDEN
            z = (z ^ (z >> _S30)) * _MUL1
            z = (z ^ (z >> _S27)) * _MUL2
            z = z ^ (z >> _S31)
            draw = (z >> ((_ONE64 - (index & _ONE64)) << _S5)) & _LOW32  # even: the high half, odd: the low
            factor[c] = scale * np.float32(draw >= cut)
        for c in range(n):
            out[r, c] = x[r, c] * factor[c]
        for c in range(n, W):
            out[r, c] = zero


class Dropout:
    """CpuBackend's dropout (a mixin)."""

    def dropout(self, x, out, rows):
        """out[R, W] = x with the elements ``rows`` (a DropRows) draws dropped and the rest scaled by 1/(1 − p);
        out may be x. The same call on the gradient is the backward pass (dropout_mask.py)."""
        R, W = self._dropout_args(x, out, rows)
        group = rows.group or max(R, 1)
        _dropout(x, out, np.uint64(rows.key), np.uint64(threshold(rows.p)), keep_scale(rows.p), rows.row0, group,
                 rows.stride or group, bool(rows.causal))
