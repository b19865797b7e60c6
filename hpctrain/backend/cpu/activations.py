"""Element-wise ops on the CPU: ReLU, GELU (exact: erf), tanh forward and backward, and the residual add.

GELU takes exp(−x²/2) from numpy's SIMD exp, then a vectorised erf polynomial (``jit_fast``).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from .jit import jit, jit_fast

__all__ = ["Activations", "add_inplace"]

_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@jit
def add_inplace(out, x):
    o = out.ravel()
    v = x.ravel()
    for i in range(o.size):
        o[i] += v[i]


@jit
def _relu_forward(x, out):
    xs, o = x.ravel(), out.ravel()
    for i in range(xs.size):
        o[i] = np.float32(0.0) if xs[i] <= 0 else xs[i]  # NaN passes through, as in torch


@jit
def _relu_backward(x, dout, dinp):
    xs, d, di = x.ravel(), dout.ravel(), dinp.ravel()
    for i in range(xs.size):
        di[i] = d[i] if xs[i] > 0 else np.float32(0.0)


# The GELU's erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), the formula of torch's vectorised
# CPU erf, so GELU matches torch.nn.GELU on the CPU. Its exp(-x²/2) comes from numpy's SIMD exp,
# written into the output array first; the loops below then vectorise (fast math inside them only).

_ERF_P, _ERF_A = 0.3275911, (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


@numba.njit(inline="always", cache=True)
def _gelu_cdf(v, e):
    """Φ(v) = (1 + erf(v/√2)) / 2 of float32 v, given e = exp(-v²/2)."""
    f32 = np.float32
    t = f32(1.0) / (f32(1.0) + f32(_ERF_P * _SQRT_HALF) * abs(v))
    poly = t * (f32(_ERF_A[0]) + t * (f32(_ERF_A[1]) + t * (f32(_ERF_A[2]) + t * (f32(_ERF_A[3])
                                                                                + t * f32(_ERF_A[4])))))
    erf = f32(1.0) - poly * e
    return f32(0.5) * (f32(1.0) + (erf if v >= 0 else -erf))


@jit_fast
def _gelu_forward_from_exp(x, out):
    """out = x · Φ(x), where out holds exp(-x²/2) on entry."""
    xs, o = x.ravel(), out.ravel()
    for i in range(xs.size):
        o[i] = xs[i] * _gelu_cdf(xs[i], o[i])


@jit_fast
def _gelu_backward_from_exp(x, dout, dinp):
    """dinp = dout · (Φ(x) + x·φ(x)), where dinp holds exp(-x²/2) on entry."""
    xs, d, di = x.ravel(), dout.ravel(), dinp.ravel()
    for i in range(xs.size):
        e = di[i]
        di[i] = d[i] * (_gelu_cdf(xs[i], e) + xs[i] * np.float32(_INV_SQRT_2PI) * e)


def _exp_neg_half_square(x, out):
    np.multiply(x, x, out=out)
    out *= np.float32(-0.5)
    np.exp(out, out=out)


def _gelu_forward(x, out):
    _exp_neg_half_square(x, out)
    _gelu_forward_from_exp(x, out)


def _gelu_backward(x, dout, dinp):
    _exp_neg_half_square(x, dinp)
    _gelu_backward_from_exp(x, dout, dinp)


@jit
def _tanh_forward(x, out):
    xs, o = x.ravel(), out.ravel()
    for i in range(xs.size):
        o[i] = math.tanh(xs[i])


@jit
def _tanh_backward(y, dout, dinp):
    ys, d, di = y.ravel(), dout.ravel(), dinp.ravel()
    for i in range(ys.size):
        di[i] = d[i] * (1.0 - ys[i] * ys[i])


class Activations:
    """CpuBackend's activations and residual add (a mixin)."""

    def relu_forward(self, x, out):
        self._unary("relu_forward", _relu_forward, x, out)

    def relu_backward(self, x, dout, dinp):
        self._binary("relu_backward", _relu_backward, x=self._kept("relu_backward", x, dout), dout=dout, dinp=dinp)

    def gelu_forward(self, x, out):
        if self.bf16_storage is None or out.dtype != self.bf16_storage:
            self._unary("gelu_forward", _gelu_forward, x, out)
            return
        self._arg("gelu_forward", "out", out, shape=self._arg("gelu_forward", "x", x).shape, dtype=out.dtype)
        wide = np.empty(out.shape, np.float32)  # empty_product_input's bfloat16: rounded as the product would
        _gelu_forward(x, wide)
        out[...] = wide

    def gelu_backward(self, x, dout, dinp):
        self._binary("gelu_backward", _gelu_backward, x=self._kept("gelu_backward", x, dout), dout=dout, dinp=dinp)

    def tanh_forward(self, x, out):
        self._unary("tanh_forward", _tanh_forward, x, out)

    def tanh_backward(self, y, dout, dinp):
        self._binary("tanh_backward", _tanh_backward, y=y, dout=dout, dinp=dinp)

    def add_(self, out, x):
        """out += x (same shapes): a residual connection and its gradient."""
        self._binary("add_", add_inplace, out=out, x=x)

    def _kept(self, op, x, dout):
        """An activation's kept input as its kernel reads it: float32; one held in ``bf16_storage``
        (``kept_output``) widened to a float32 copy (exact), after checking it has dout's shape."""
        if self.bf16_storage is None or x.dtype != self.bf16_storage:
            return x
        self._arg(op, "x", x, shape=self._arg(op, "dout", dout).shape, dtype=self.bf16_storage)
        return x.astype(np.float32)

    def _unary(self, op, kernel, x, out):
        """out = f(x) by ``kernel`` after ``op``'s argument checks (x and out of one shape)."""
        self._unary_args(op, x, out)
        kernel(x, out)

    def _binary(self, op, kernel, **arrays):
        """``kernel`` over ``arrays`` in their order, after ``op``'s check that all have the first one's shape."""
        self._check_same(op, **arrays)
        kernel(*arrays.values())
