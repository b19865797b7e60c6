"""Optimizer kernels on the CPU: torch.optim.SGD and Adam/AdamW over a flat buffer (``numba.njit``), the sum of
squares (the gradient norm², float64) and the in-place scale. Shape letter n: elements of the flat buffer.
"""

from __future__ import annotations

import math

import numpy as np

from ..base import DecayRuns
from .jit import jit, jit_reduce

__all__ = ["Optim"]


@jit_reduce
def _sum_squares(x):
    acc = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        acc += v * v
    return acc


@jit
def _scale(x, s):
    for i in range(x.size):
        x[i] *= s


# The updates run in float32 like torch.optim's, with the branches hoisted out of the loops so
# that LLVM vectorises them.


@jit
def _sgd_plain(p, g, gs, lr, weight_decay):
    for i in range(p.size):
        p[i] -= lr * (g[i] * gs + weight_decay * p[i])


@jit
def _sgd_momentum(p, g, gs, buf, lr, momentum, weight_decay, nesterov):
    if nesterov:
        for i in range(p.size):
            d = g[i] * gs + weight_decay * p[i]
            b = momentum * buf[i] + d
            buf[i] = b
            p[i] -= lr * (d + momentum * b)
    else:
        for i in range(p.size):
            b = momentum * buf[i] + (g[i] * gs + weight_decay * p[i])
            buf[i] = b
            p[i] -= lr * b


@jit
def _adam_update(p, g, gs, m, v, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps, l2, keep):
    """keep = 1 − lr·wd for AdamW (decoupled), 1 for Adam; l2 = wd for Adam, 0 for AdamW; omb1, omb2 =
    1 − β1, 1 − β2 computed in float64 (torch.optim's Python floats): in float32, 1 − 0.99999 is 0.1% off;
    gs: the clipping factor, applied to each gradient as it is read (the same product scale_ would store)."""
    for i in range(p.size):
        w = p[i] * keep
        d = g[i] * gs + l2 * p[i]
        mi = beta1 * m[i] + omb1 * d
        vi = beta2 * v[i] + omb2 * d * d
        m[i] = mi
        v[i] = vi
        p[i] = w - step_size * mi / (np.sqrt(vi) / bc2_sqrt + eps)


class Optim:
    """CpuBackend's optimizer steps and flat-buffer reductions (a mixin)."""

    def sum_squares(self, x, *, into=None):
        self._into_arg("sum_squares", into, 1)
        total = float(_sum_squares(self._arg("sum_squares", "x", x, ndim=1)))
        if into is None:
            return total
        into[0] = total

    def scale_(self, x, s):
        _scale(self._arg("scale_", "x", x, ndim=1), np.float32(s))

    def sgd_update(self, param, grad, momentum_buf, *, lr, momentum, weight_decay, nesterov, grad_scale=1.0):
        self._check_flat("sgd_update", param=param, grad=grad, momentum_buf=momentum_buf)
        self._check_decay("sgd_update", weight_decay, param.shape[0])
        if isinstance(weight_decay, DecayRuns):  # run by run: a call costs microseconds here, not a launch
            for lo, hi, d in weight_decay.runs:
                self.sgd_update(param[lo:hi], grad[lo:hi], momentum_buf[lo:hi], lr=lr, momentum=momentum,
                                weight_decay=d, nesterov=nesterov, grad_scale=grad_scale)
            return
        f32 = np.float32
        if momentum == 0:
            _sgd_plain(param, grad, f32(grad_scale), f32(lr), f32(weight_decay))
        else:
            _sgd_momentum(param, grad, f32(grad_scale), momentum_buf, f32(lr), f32(momentum), f32(weight_decay),
                          bool(nesterov))

    def adam_update(self, param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, decoupled,
                    grad_scale=1.0):
        self._check_flat("adam_update", param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        self._check_decay("adam_update", weight_decay, param.shape[0])
        if isinstance(weight_decay, DecayRuns):
            for lo, hi, d in weight_decay.runs:
                self.adam_update(param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], lr=lr, beta1=beta1,
                                 beta2=beta2, eps=eps, weight_decay=d, step=step, decoupled=decoupled,
                                 grad_scale=grad_scale)
            return
        f32 = np.float32
        step_size = lr / (1.0 - beta1**step)
        bc2_sqrt = math.sqrt(1.0 - beta2**step)
        keep, l2 = (1.0 - lr * weight_decay, 0.0) if decoupled else (1.0, weight_decay)
        _adam_update(param, grad, f32(grad_scale), exp_avg, exp_avg_sq, f32(step_size), f32(beta1), f32(beta2),
                     f32(1.0 - beta1), f32(1.0 - beta2), f32(bc2_sqrt), f32(eps), f32(l2), f32(keep))
