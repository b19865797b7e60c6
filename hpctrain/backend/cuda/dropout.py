"""Dropout on the GPU: dropout_mask.py's counter-based draw, bit for bit, fused with the 1/(1 − p) scale.

The same call on the gradient is the backward pass (the mask is drawn again from the element indices).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
from numba import cuda, uint64

from ..dropout_mask import GOLDEN, MUL1, MUL2, keep_scale, mix64, threshold
from . import blocks
from .memory import flat

__all__ = ["kernels", "Dropout"]

_ZERO = np.float32(0.0)
_GOLDEN, _MUL1, _MUL2 = np.uint64(GOLDEN), np.uint64(MUL1), np.uint64(MUL2)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_ONE64, _LOW32 = np.uint64(1), np.uint64(0xFFFFFFFF)


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """The dropout kernel for blocks of ``nt`` threads; compiled lazily, once per process."""
    kernel = blocks.kernel_decorator(nt)

    @kernel
    def dropout(x, out, W, key, site, steps, derive, cut, scale, row0, group, stride, causal):
        """out[n] = x[n] · (scale if the draw of its global index is >= cut else 0) over a flat (R, W) array, row
        r's elements having the indices (row0 + (r // group)·stride + r % group)·W + c; the draw is a half of
        mix64(key ^ (index >> 1)), the high one for an even index; causal: 0 for c > r mod W (dropout_mask.py:
        the CPU backend's and numpy's draw, bit for bit)."""
        key = blocks.site_key(key, steps[0], site) if derive else key
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            r = i // W
            c = i - r * W
            if causal and c > r % W:
                out[i] = _ZERO
                continue
            index = uint64(row0 + (r // group) * stride + r % group) * uint64(W) + uint64(c)
            z = (key ^ (index >> _ONE64)) + _GOLDEN
            z = (z ^ (z >> _S30)) * _MUL1
            z = (z ^ (z >> _S27)) * _MUL2
            z = z ^ (z >> _S31)
            draw = (z & _LOW32) if index & _ONE64 else (z >> _S32)
            out[i] = x[i] * (scale if draw >= cut else _ZERO)

    return SimpleNamespace(dropout=dropout)


class Dropout:
    """CudaBackend's dropout (a mixin)."""

    def _site_key(self, rows):
        """A dropout kernel's (key, site, steps, derive): for a draw whose seed is known, the seed's mix, the site
        and the step in device memory, from which the kernel derives site_key (the same launch every step); else
        the key itself."""
        if rows.seed < 0:
            return np.uint64(rows.key), np.uint64(0), self._step_dev, False  # (not read)
        return np.uint64(mix64(rows.seed)), np.uint64(rows.site), self._device_step(rows.step), True

    def _device_step(self, step: int):
        """The one-element uint64 device array the dropout kernels read the step from, holding ``step`` once
        what is queued so far runs (a copy from page-locked memory when it changes: once a step)."""
        if self._step_on_device != step:
            if self._step_copied is not None:
                self.host_wait_for(self._step_copied)  # the page-locked value of the last change is read
            self._step_host[0] = step
            self._host_acts()
            self._step_dev.copy_to_device(self._step_host, stream=self.stream)
            self._step_copied, self._step_on_device = self.mark(), step
        return self._step_dev

    def dropout(self, x, out, rows):
        """out[R, W] = x with the elements ``rows`` (a DropRows) draws dropped and the rest scaled by 1/(1 − p);
        out may be x. The same call on the gradient is the backward pass (dropout_mask.py)."""
        R, W = self._dropout_args(x, out, rows)
        group = rows.group or max(R, 1)
        self._elementwise(self._k.dropout, R * W, flat(x), flat(out), W, *self._site_key(rows),
                          np.uint64(threshold(rows.p)), keep_scale(rows.p), rows.row0, group, rows.stride or group,
                          bool(rows.causal))
