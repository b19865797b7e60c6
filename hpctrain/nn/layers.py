"""Layers: forward and backward side by side, each calling backend kernels.

Shape letters: B batch rows, C features. ``forward(be, x)`` (``forward(be, x, key)`` for a layer with
``dropout``) returns
``(out, saved)``: what the backward pass needs is returned explicitly, never
stashed on the layer. ``backward(be, dout, saved, accumulate, need_dinp)``
writes the parameter gradients into the gradient views (adding when
``accumulate``) and returns the input gradient (None when not needed).
Parameter names and shapes follow torch.nn: Linear weight is (out, in).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from ..layer_kinds import registered

__all__ = ["Layer", "Linear", "Activation", "ReLU", "GELU", "Tanh", "LayerNorm", "make_layer"]


class Layer:
    params: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # parameters the layer uses but another layer owns (a head tied to the token embedding): named like
    # ``params``, and this layer's prefix + the name must be the owner's global name (see nn/model.py)
    ties: tuple[tuple[str, tuple[int, ...]], ...] = ()
    in_features: int | None = None  # None: any width, output width = input width
    out_features: int | None = None
    # > 0: the layer drops in training, and its ``forward(be, x, key)`` takes the micro-batch's DropoutKey
    # (nn/dropout.py; None in evaluation); 0: ``forward(be, x)``
    dropout: float = 0.0

    def init(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {}

    def flops(self) -> int:
        """Forward FLOPs per row (token) this layer costs, for cutting pipeline stages: 2 per parameter, a
        dense layer's multiply-add per weight (the backward costs about twice that everywhere alike)."""
        return 2 * sum(int(np.prod(shape)) for _, shape in self.params)

    def scratch_bytes(self, rows: int, device: bool) -> int:
        """Bytes the layer's forward or backward allocates for itself and frees before it returns (a kernel's
        scratch), at ``rows`` input rows on a device (or host) backend: part of the memory plan's working set."""
        return 0

    def bind(self, weights: dict, grads: dict, accumulating=frozenset()) -> None:
        """Give the layer its parameter and gradient views (local names). ``accumulating`` names the
        gradients another layer of the same part writes first in the backward pass: this layer adds to them."""
        self.w, self.g, self.accumulating = weights, grads, accumulating

    def backward_input(self, be, dout, saved, accumulate=False, need_dinp=True):
        """The zero-bubble schedule's B: (input gradient, what ``backward_weight`` needs). A layer that does not
        split its backward writes its parameter gradients here too and returns None for W."""
        return self.backward(be, dout, saved, accumulate=accumulate, need_dinp=need_dinp), None

    def backward_weight(self, be, wsaved, accumulate=False) -> None:
        """The zero-bubble schedule's W: the parameter gradients from what ``backward_input`` returned."""


class Linear(Layer):
    """y[B,out] = x[B,in] · Wᵀ + b, W of shape (out, in) as in torch.nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.params = (("weight", (out_features, in_features)),) + ((("bias", (out_features,)),) if bias else ())

    def init(self, rng):
        bound = 1.0 / math.sqrt(self.in_features)  # torch: kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(in), 1/sqrt(in))
        out = {"weight": rng.uniform(-bound, bound, (self.out_features, self.in_features)).astype(np.float32)}
        if self.has_bias:
            out["bias"] = rng.uniform(-bound, bound, (self.out_features,)).astype(np.float32)
        return out

    def forward(self, be, x):
        """Keeps x as the products read it (``be.product_input``: bfloat16 under train.precision = "bf16")."""
        x = be.product_input(x)
        out = be.empty((x.shape[0], self.out_features))
        be.matmul_nt(x, self.w["weight"], out, bias=self.w.get("bias"))
        return out, x

    def backward(self, be, dout, x, accumulate=False, need_dinp=True):
        be.matmul_tn(dout, x, self.g["weight"], accumulate=accumulate)
        if self.has_bias:
            be.bias_grad(dout, self.g["bias"], accumulate=accumulate)
        if not need_dinp:
            return None
        dinp = be.empty(x.shape)
        be.matmul_nn(dout, self.w["weight"], dinp)
        return dinp

    def backward_input(self, be, dout, x, accumulate=False, need_dinp=True):
        """B: dinp = dout · W; W needs (dout, x)."""
        dinp = None
        if need_dinp:
            dinp = be.empty(x.shape)
            be.matmul_nn(dout, self.w["weight"], dinp)
        return dinp, (dout, x)

    def backward_weight(self, be, wsaved, accumulate=False):
        """W: dW = doutᵀ · x and db = Σ dout, the same kernels as ``backward``."""
        dout, x = wsaved
        be.matmul_tn(dout, x, self.g["weight"], accumulate=accumulate)
        if self.has_bias:
            be.bias_grad(dout, self.g["bias"], accumulate=accumulate)


class Activation(Layer):
    """An element-wise activation: ``<kernel>_forward(x, out)`` and ``<kernel>_backward(saved, dout, dinp)``."""

    kernel = ""
    saves_output = False  # tanh's backward needs tanh(x), the others need x

    def __init__(self, after_product: bool = False, before_product: bool = False):
        # after_product: x is a product's output as it is (a Linear's, a column-parallel one's): the activation
        # keeps it as ``be.kept_output`` holds it, bfloat16 under train.precision = "bf16" (exact: the product
        # rounded x). before_product: only a product reads the output (a GPT block's GELU): it is written as
        # ``be.empty_product_input`` holds it, rounded by the kernel as the product would round it
        self.after_product = after_product and not self.saves_output
        self.before_product = before_product and not self.saves_output

    def forward(self, be, x):
        out = be.empty_product_input(x.shape) if self.before_product else be.empty(x.shape)
        getattr(be, f"{self.kernel}_forward")(x, out)
        if self.saves_output:
            return out, out
        return out, (be.kept_output(x) if self.after_product else x)

    def backward(self, be, dout, saved, accumulate=False, need_dinp=True):
        dinp = be.empty(saved.shape)
        getattr(be, f"{self.kernel}_backward")(saved, dout, dinp)
        return dinp


class ReLU(Activation):
    kernel = "relu"


class GELU(Activation):
    """Exact GELU, 0.5·x·(1 + erf(x/√2)): torch.nn.GELU's default."""

    kernel = "gelu"


class Tanh(Activation):
    kernel = "tanh"
    saves_output = True


class LayerNorm(Layer):
    """Normalise over the last dimension, then scale and shift, as torch.nn.LayerNorm(dim, eps, bias=bias)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        self.in_features = self.out_features = dim
        self.eps, self.has_bias = eps, bias
        self.params = (("weight", (dim,)),) + ((("bias", (dim,)),) if bias else ())

    def init(self, rng):
        C = self.out_features
        return {"weight": np.ones(C, np.float32), **({"bias": np.zeros(C, np.float32)} if self.has_bias else {})}

    def bind(self, weights, grads, accumulating=frozenset()):
        super().bind(weights, grads, accumulating)
        self._zero_bias = self._bias_grad_scratch = None  # without a bias: a zero shift, a gradient to discard

    def _bias(self, be):
        if self.has_bias:
            return self.w["bias"], self.g["bias"]
        if self._zero_bias is None:
            self._zero_bias, self._bias_grad_scratch = be.zeros((self.out_features,)), be.empty((self.out_features,))
        return self._zero_bias, self._bias_grad_scratch

    def forward(self, be, x, *, for_product: bool = False):
        """``for_product``: only a product reads the output (a GPT's LayerNorms before c_attn, c_fc and the head):
        it is written as ``be.empty_product_input`` holds it (bfloat16 under bf16, rounded by the kernel)."""
        B = x.shape[0]
        out, mean, rstd = self._out(be, x.shape, for_product), be.empty((B,)), be.empty((B,))
        be.layernorm_forward(x, self.w["weight"], self._bias(be)[0], self.eps, out, mean, rstd)
        return out, (x, mean, rstd)

    @staticmethod
    def _out(be, shape, for_product):
        return be.empty_product_input(shape) if for_product else be.empty(shape)

    def backward(self, be, dout, saved, accumulate=False, need_dinp=True):
        x, mean, rstd = saved
        dinp = be.empty(x.shape)
        be.layernorm_backward(dout, x, self.w["weight"], mean, rstd, dinp, self.g["weight"], self._bias(be)[1],
                              accumulate=accumulate)
        return dinp

    def forward_residual(self, be, x, residual, *, for_product: bool = False):
        """x += residual (in place: x becomes the residual stream after the add), then ``forward`` of it, fused
        (the backend's ``residual_layernorm_forward``); saves what ``backward_residual`` needs."""
        B = x.shape[0]
        out, mean, rstd = self._out(be, x.shape, for_product), be.empty((B,)), be.empty((B,))
        be.residual_layernorm_forward(x, residual, self.w["weight"], self._bias(be)[0], self.eps, out, mean, rstd)
        return out, (x, mean, rstd)

    def backward_residual(self, be, dout, saved, dresidual, accumulate=False):
        """The gradient of ``forward_residual``'s sum: ``backward``'s plus dresidual, the residual stream's
        gradient after the add, which goes straight through (fused: ``residual_layernorm_backward``)."""
        x, mean, rstd = saved
        dinp = be.empty(x.shape)
        be.residual_layernorm_backward(dout, dresidual, x, self.w["weight"], mean, rstd, dinp, self.g["weight"],
                                       self._bias(be)[1], accumulate=accumulate)
        return dinp


def make_layer(spec) -> Layer:
    """Build a layer from a config ``LayerSpec``: a built-in kind, or one registered with
    ``hpctrain.register_layer`` (layer_kinds.py)."""
    if spec.type == "linear":
        return Linear(spec.get("in"), spec.get("out"), spec.get("bias", True))
    if spec.type == "layernorm":
        return LayerNorm(spec.get("dim"), spec.get("eps", 1e-5))
    builtin = {"relu": ReLU, "gelu": GELU, "tanh": Tanh}.get(spec.type)
    if builtin is not None:
        return builtin()
    plugin = registered(spec.type)
    if plugin is None:
        raise ConfigError(f"layer type {spec.type!r} is not registered in this process (hpctrain --plugin MODULE)")
    layer = plugin.build(**dict(spec.args))
    if not isinstance(layer, Layer):
        raise ConfigError(not_a_layer(spec.type, plugin, layer))
    return layer


def not_a_layer(kind: str, plugin, layer) -> str:
    """The refusal of a registered kind whose build returned something that is not a ``Layer``."""
    return (f"layer type {kind!r} ({plugin.module}): build returned a {type(layer).__name__}, not a "
            "hpctrain.nn.Layer: subclass it (it supplies what the model asks of every layer besides params, init, "
            "forward and backward: ties, dropout, bind, flops, scratch_bytes, the zero-bubble halves)")
