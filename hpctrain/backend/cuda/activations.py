"""Element-wise kernels on the GPU: ReLU, GELU (exact, erf), tanh forward and backward, the residual add, and the
rounding to bfloat16 of ``train.precision = "bf16"`` (precision.py).

Shape letter n: elements of a flat buffer; the kernels are grid-stride loops over it, so any grid covers any n
(the backend caps the grid; the simulator runs a tiny one). Arithmetic is float32 (float32 literals keep numba
off the float64 units). The CPU backend's are cpu/activations.py. Under bf16 an activation may read its kept input
as bfloat16 words and GELU may write its output as them (``*_bf16`` kernels: ``bf16_widener``, ``bf16_narrower``).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, int32, uint16, uint32

from . import blocks, sim
from .memory import flat

__all__ = ["kernels", "Activations"]

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_SQRT_HALF = np.float32(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI = np.float32(1.0 / math.sqrt(2.0 * math.pi))
# float32 bit patterns for round_bf16
_ABS_BITS, _INF_BITS, _QUIET_BIT = np.uint32(0x7FFFFFFF), np.uint32(0x7F800000), np.uint32(0x00400000)
_BF16_BITS, _HALF_BF16_ULP, _ONE_BIT = np.uint32(0xFFFF0000), np.uint32(0x7FFF), np.uint32(1)
_SHIFT = np.uint32(16)


@cuda.jit(device=True)
def _bf16_bits(u):
    """The float32 bits ``u`` rounded to bfloat16 (to nearest even; the lower 16 bits zero). A NaN stays a NaN
    (quiet, its sign and upper payload kept); a value past bfloat16's largest rounds to infinity."""
    if (u & _ABS_BITS) > _INF_BITS:
        return (u | _QUIET_BIT) & _BF16_BITS
    return (u + _HALF_BF16_ULP + ((u >> _SHIFT) & _ONE_BIT)) & _BF16_BITS


@functools.cache
def bf16_widener():
    """A device function: the float32 of bfloat16 bits ``w`` (a uint16 word; exact: the bits in the upper half of
    a float32). On a GPU libdevice's ``int_as_float`` (a register move); the simulator, which has no libdevice,
    reinterprets a numpy scalar's bits."""
    if sim.simulator():
        def widen(w):
            return (np.uint32(w) << _SHIFT).view(np.float32)
    else:
        from numba.cuda import libdevice

        def widen(w):
            return libdevice.int_as_float(int32(uint32(w) << _SHIFT))
    return cuda.jit(device=True)(widen)


@functools.cache
def bf16_narrower():
    """A device function: float32 ``v`` rounded to bfloat16 (to nearest even, ``_bf16_bits``) as its uint16 word.
    On a GPU the float's bits by libdevice's ``float_as_int`` (a register move); the simulator reads a numpy
    scalar's."""
    if sim.simulator():
        def narrow(v):
            return uint16(_bf16_bits(np.float32(v).view(np.uint32)) >> _SHIFT)
    else:
        from numba.cuda import libdevice

        def narrow(v):
            return uint16(_bf16_bits(uint32(libdevice.float_as_int(v))) >> _SHIFT)
    return cuda.jit(device=True)(narrow)


@cuda.jit(device=True)
def _gelu(v):
    """GELU(v) = v·Φ(v), exact."""
    return _HALF * v * (_ONE + math.erf(v * _SQRT_HALF))


@cuda.jit(device=True)
def _gelu_slope(v):
    """GELU'(v) = Φ(v) + v·φ(v)."""
    cdf = _HALF * (_ONE + math.erf(v * _SQRT_HALF))
    return cdf + v * (_INV_SQRT_2PI * math.exp(-_HALF * v * v))


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """The element-wise kernels for blocks of ``nt`` threads; compiled lazily, once per process."""
    NT, kernel = nt, blocks.kernel_decorator(nt)
    widen, narrow = bf16_widener(), bf16_narrower()

    @kernel
    def relu_forward(x, out):
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            v = x[i]
            out[i] = _ZERO if v <= _ZERO else v  # NaN passes through, as in torch

    @kernel
    def relu_backward(x, dout, dinp):
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            dinp[i] = dout[i] if x[i] > _ZERO else _ZERO

    @kernel
    def relu_backward_bf16(x, dout, dinp):
        """``relu_backward`` of x held as bfloat16 words (``kept_output``)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            dinp[i] = dout[i] if widen(x[i]) > _ZERO else _ZERO

    @kernel
    def gelu_forward(x, out):
        """Exact GELU: 0.5·x·(1 + erf(x/√2))."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = _gelu(x[i])

    @kernel
    def gelu_forward_bf16(x, out):
        """``gelu_forward`` into bfloat16 words (``empty_product_input``: a product reads the output only)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = narrow(_gelu(x[i]))

    @kernel
    def gelu_backward(x, dout, dinp):
        """dinp = dout·(Φ(x) + x·φ(x))."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            dinp[i] = dout[i] * _gelu_slope(x[i])

    @kernel
    def gelu_backward_bf16(x, dout, dinp):
        """``gelu_backward`` of x held as bfloat16 words (``kept_output``)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            dinp[i] = dout[i] * _gelu_slope(widen(x[i]))

    @kernel
    def tanh_forward(x, out):
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = math.tanh(x[i])

    @kernel
    def tanh_backward(y, dout, dinp):
        """Takes y = tanh(x), as the layer saves it."""
        for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
            v = y[i]
            dinp[i] = dout[i] * (_ONE - v * v)

    @kernel
    def add(out, x):
        """out[n] += x[n] (a residual connection and its gradient)."""
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] += x[i]

    @kernel
    def copy(x, out):
        """out[n] = x[n]: a device copy that a step graph holds as a kernel (the cuBLASLt bias's aligned copy)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = x[i]

    @kernel
    def round_bf16(x, out):
        """out[n] = x[n] rounded to bfloat16, to nearest even (ml_dtypes' cast), on float32 bits: both arrays are
        float32 buffers viewed as uint32, out may be x (``_bf16_bits``)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = _bf16_bits(x[i])

    @kernel
    def to_bf16(x, out):
        """out[n] = the bfloat16 of x[n] as its 16 bits (uint16), rounded as ``round_bf16``; x a float32 buffer
        viewed as uint32: a product's operand held in half the bytes (precision.py)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = uint16(_bf16_bits(x[i]) >> _SHIFT)

    @kernel
    def from_bf16(x, out):
        """out[n] = the float32 of the bfloat16 bits x[n] (exact: the bits in the upper half); out a float32
        buffer viewed as uint32."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = uint32(x[i]) << _SHIFT

    return SimpleNamespace(relu_forward=relu_forward, relu_backward=relu_backward,
                           relu_backward_bf16=relu_backward_bf16, gelu_forward=gelu_forward,
                           gelu_forward_bf16=gelu_forward_bf16, gelu_backward=gelu_backward,
                           gelu_backward_bf16=gelu_backward_bf16,
                           tanh_forward=tanh_forward, tanh_backward=tanh_backward, add=add, copy=copy,
                           round_bf16=round_bf16, to_bf16=to_bf16, from_bf16=from_bf16)


def _activation(kind: str, saved: str = "x"):
    """(``<kind>_forward(x, out)``, ``<kind>_backward(<saved>, dout, dinp)``): the two methods of one activation,
    launching the kernels of the same names after their argument checks; ``saved`` names what the backward
    takes (tanh's is its output y). A backward whose x is held in ``bf16_storage`` (``kept_output``: a
    product's output under bf16) launches ``<kind>_backward_bf16``, which widens it as it reads it; a forward into
    ``bf16_storage`` (``empty_product_input``), ``<kind>_forward_bf16`` where there is one (GELU's), which rounds
    as it writes."""

    def forward(self, x, out):
        op = f"{kind}_forward"
        if self.bf16_storage is not None and out.dtype == self.bf16_storage and hasattr(self._k, f"{op}_bf16"):
            self._arg(op, "out", out, shape=self._arg(op, "x", x).shape, dtype=self.bf16_storage)
            self._elementwise(getattr(self._k, f"{op}_bf16"), x.size, flat(x), flat(out))
            return
        self._unary(op, getattr(self._k, op), x=x, out=out)

    def backward(self, s, dout, dinp):
        op = f"{kind}_backward"
        if saved == "x" and self.bf16_storage is not None and s.dtype == self.bf16_storage:
            self._arg(op, saved, s, shape=self._arg(op, "dout", dout).shape, dtype=self.bf16_storage)
            self._binary(op, getattr(self._k, f"{op}_bf16"), **{saved: s}, dout=dout, dinp=dinp, checked=(saved,))
            return
        self._binary(op, getattr(self._k, op), **{saved: s}, dout=dout, dinp=dinp)

    forward.__name__, backward.__name__ = f"{kind}_forward", f"{kind}_backward"
    backward.__doc__ = f"dinp = dout · {kind}'({saved})"
    return forward, backward


class Activations:
    """CudaBackend's activations and residual add (a mixin: ``self._k`` holds the kernels, ``self._elementwise``
    launches them)."""

    relu_forward, relu_backward = _activation("relu")
    gelu_forward, gelu_backward = _activation("gelu")
    tanh_forward, tanh_backward = _activation("tanh", saved="y")

    def add_(self, out, x):
        """out += x (same shapes): a residual connection and its gradient."""
        self._binary("add_", self._k.add, out=out, x=x)

    def _unary(self, op, kernel, *, x, out):
        self._unary_args(op, x, out)
        self._elementwise(kernel, x.size, flat(x), flat(out))

    def _binary(self, op, kernel, *, checked=(), **arrays):
        """``kernel`` over ``arrays`` (flat), after ``op``'s check that all but those named in ``checked`` (checked
        by the caller) are float32 arrays of the first one's shape."""
        self._check_same(op, **{name: a for name, a in arrays.items() if name not in checked})
        first = next(iter(arrays.values()))
        self._elementwise(kernel, first.size, *(flat(a) for a in arrays.values()))
