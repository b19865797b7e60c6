"""A registered layer (layer_kinds.py) held to the layer contract where it hands something back.

A built-in layer is tested; a user's is not, and what it gets wrong shows up far away: an output of the wrong
width fails in the next layer's kernel, which names that kernel, and at a pipeline stage's boundary it is sent as
it is, where a shorter message fits the receive buffer and training goes on with garbage. ``CheckedLayer``
wraps every registered layer in a model and checks each result as the layer returns it:

* ``init``: exactly the declared tensors, each of its declared shape;
* ``forward``: a float32 array of (rows, the layer's output width);
* ``backward`` / ``backward_input``: an input gradient of the input's shape, float32.

A breach is one ``LayerContractError`` naming the layer (``model.layers[i]``, its type and plugin module) and
what it returned. Everything else (``params``, ``bind``, ``flops``, ...) is the layer's own. On the memory
plan's shape-only backend (plan.py) a registered layer's code does not run: it is taken to keep its input.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError

__all__ = ["CheckedLayer", "LayerContractError"]


class LayerContractError(ConfigError):
    """A registered layer returned something the layer contract does not allow."""


class CheckedLayer:
    """``layer`` (a registered kind's) with its results checked; ``where`` names it in errors, ``out_width`` is
    the width its output must have (the model's width after it)."""

    def __init__(self, layer, where: str, out_width: int):
        self.inner, self.where, self.out_width = layer, where, out_width

    def __getattr__(self, name):  # params, ties, in_features, out_features, dropout, flops, scratch_bytes, bind
        return getattr(self.inner, name)

    def init(self, rng) -> dict[str, np.ndarray]:
        made = self.inner.init(rng)
        declared = dict(self.inner.params)
        if not isinstance(made, dict) or set(made) != set(declared):
            got = sorted(made) if isinstance(made, dict) else type(made).__name__
            raise LayerContractError(f"{self.where}: init returned {got}, but params declares "
                                     f"{sorted(declared)}: init must return exactly the declared tensors")
        out = {}
        for name, shape in declared.items():
            arr = np.asarray(made[name])
            if arr.shape != tuple(shape):
                raise LayerContractError(f"{self.where}: init returned {name} of shape {arr.shape}, but params "
                                         f"declares {tuple(shape)}")
            out[name] = arr.astype(np.float32, copy=False)
        return out

    def forward(self, be, x, key=None):
        rows = x.shape[0]
        if be.name == "shapes":  # the memory plan: nothing runs; the layer is taken to keep its input
            return be.empty((rows, self.out_width)), x
        out, saved = self.inner.forward(be, x, key) if self.inner.dropout else self.inner.forward(be, x)
        self._check(out, (rows, self.out_width), "forward returned its output")
        return out, (tuple(x.shape), saved)

    def backward(self, be, dout, saved, accumulate=False, need_dinp=True):
        shape, mine = saved
        dinp = self.inner.backward(be, dout, mine, accumulate=accumulate, need_dinp=need_dinp)
        if need_dinp:
            self._check(dinp, shape, "backward returned the input gradient")
        return dinp

    def backward_input(self, be, dout, saved, accumulate=False, need_dinp=True):
        shape, mine = saved
        dinp, wsaved = self.inner.backward_input(be, dout, mine, accumulate=accumulate, need_dinp=need_dinp)
        if need_dinp:
            self._check(dinp, shape, "backward_input returned the input gradient")
        return dinp, wsaved

    def backward_weight(self, be, wsaved, accumulate=False) -> None:
        self.inner.backward_weight(be, wsaved, accumulate=accumulate)

    def _check(self, arr, shape, what: str) -> None:
        got_shape, dtype = getattr(arr, "shape", None), getattr(arr, "dtype", None)
        if got_shape is None or tuple(got_shape) != tuple(shape) or dtype != np.float32:
            got = f"{dtype} {tuple(got_shape)}" if got_shape is not None else type(arr).__name__
            raise LayerContractError(f"{self.where}: {what} as {got}, expected float32 {tuple(shape)}")
