"""Sequential: a stack of layers over one flat parameter buffer.

Parameters are named like ``torch.nn.Sequential.state_dict()``: the layer's
index, a dot, the parameter (``"0.weight"``, ``"0.bias"``, ``"2.weight"``).
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..params import FlatBuffer, ParamLayout
from .layers import LayerNorm, make_layer

__all__ = ["Sequential"]


class Sequential:
    def __init__(self, layer_specs):
        self.layers = [make_layer(spec) for spec in layer_specs]
        width = None
        for i, layer in enumerate(self.layers):
            if layer.in_features is not None and width is not None and layer.in_features != width:
                key = "dim" if isinstance(layer, LayerNorm) else "in"
                raise ConfigError(f"model.layers[{i}].{key} = {layer.in_features} does not match the previous "
                                  f"output width {width}")
            if layer.out_features is not None:
                width = layer.out_features
        first_width = next((l.in_features for l in self.layers if l.in_features is not None), None)
        if first_width is None:
            raise ConfigError("model.layers: the model needs at least one linear or layernorm layer to fix its width")
        self.in_features, self.out_features = first_width, width
        self.layout = ParamLayout((f"{i}.{name}", shape) for i, layer in enumerate(self.layers)
                                  for name, shape in layer.params)
        # the flat-buffer range each layer's gradients occupy, for bucketed gradient sync
        self.grad_ranges = []
        for i, layer in enumerate(self.layers):
            specs = [self.layout[f"{i}.{name}"] for name, _ in layer.params]
            self.grad_ranges.append((specs[0].offset, specs[-1].end) if specs else None)

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """Initial parameters as torch.nn would draw them, from a numpy generator seeded with ``seed``."""
        rng = np.random.default_rng(seed)
        out = {}
        for i, layer in enumerate(self.layers):
            for name, arr in layer.init(rng).items():
                out[f"{i}.{name}"] = arr
        return out

    def bind(self, params: FlatBuffer, grads: FlatBuffer) -> None:
        for i, layer in enumerate(self.layers):
            layer.bind({n: params[f"{i}.{n}"] for n, _ in layer.params}, {n: grads[f"{i}.{n}"] for n, _ in layer.params})

    def forward(self, be, x):
        """Return (output, saved): ``saved`` holds what each layer's backward needs."""
        saved = []
        for layer in self.layers:
            x, s = layer.forward(be, x)
            saved.append(s)
        return x, saved

    def backward(self, be, dout, saved, *, accumulate=False, on_layer_done=None):
        """Backward in reverse layer order; ``on_layer_done(i)`` runs once layer i's gradients are written."""
        for i in range(len(self.layers) - 1, -1, -1):
            dout = self.layers[i].backward(be, dout, saved[i], accumulate=accumulate, need_dinp=i > 0)
            if on_layer_done is not None:
                on_layer_done(i)
        return dout
