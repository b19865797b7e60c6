"""Your own layer: a residual feed-forward block, y = x + W₂·gelu(W₁·x + b₁) + b₂, registered as "resmlp".

    python examples/custom_layer.py --steps 200                 # the digits MLP with a resmlp block, one rank
    mpiexec -n 2 python examples/custom_layer.py                # two data-parallel ranks
    PYTHONPATH=examples hpctrain --plugin custom_layer train my.toml   # a config with {type = "resmlp", ...}
    PYTHONPATH=examples hpctrain --plugin custom_layer inspect runs/examples/resmlp/ckpt-00000600.h5

A layer (``hpctrain.nn.Layer``) names its parameters and their shapes (``params``), initialises them (``init``),
and writes ``forward`` and ``backward`` with the backend's kernels (hpctrain/backend/base.py: ``matmul_nt``,
``gelu_forward``, ``add_``, ...), so the same code runs on the CPU and on the CUDA backend. ``forward(be, x)``
returns ``(out, saved)``; ``backward(be, dout, saved, accumulate, need_dinp)`` writes the parameter gradients into
``self.g`` (adding when ``accumulate``) and returns the input gradient. ``in_features``/``out_features`` give its
widths. Data, pipeline and ZeRO parallelism take it as they take a built-in layer (its parameters live in the
flat buffers; a pipeline cut falls before it); tensor parallelism leaves it whole on every tp rank.

``register_layer`` makes ``type = "resmlp"`` valid in ``model.layers`` with the keys it declares. The command
line registers it on every rank with ``--plugin custom_layer`` (or ``HPCTRAIN_PLUGINS=custom_layer``); a
checkpoint records the module (``hpctrain inspect`` shows it) and is read back by any command given the plugin.
tests/test_custom_layer.py checks its gradients by finite differences and trains it on one and two ranks.
"""

import argparse
import math
import os

import numpy as np

from hpctrain import register_layer
from hpctrain.nn import Layer, Linear


class ResidualMLP(Layer):
    """x + proj(gelu(fc(x))), widths dim -> hidden -> dim; parameters named as nanoGPT's MLP (fc, proj)."""

    def __init__(self, dim: int, hidden: int, init_scale: float = 1.0):
        if dim < 1 or hidden < 1:
            raise ValueError(f"dim and hidden must be >= 1, got {dim} and {hidden}")
        self.in_features = self.out_features = dim
        self.init_scale = init_scale
        self.fc, self.proj = Linear(dim, hidden), Linear(hidden, dim)
        self.params = tuple((f"{name}.{p}", shape) for name, part in (("fc", self.fc), ("proj", self.proj))
                            for p, shape in part.params)

    def init(self, rng):
        fc, proj = self.fc.init(rng), self.proj.init(rng)
        proj = {k: v * np.float32(self.init_scale) for k, v in proj.items()}  # a small residual branch at first
        return {**{f"fc.{k}": v for k, v in fc.items()}, **{f"proj.{k}": v for k, v in proj.items()}}

    def flops(self):
        return 2 * sum(math.prod(shape) for _, shape in self.params)

    def bind(self, weights, grads, accumulating=frozenset()):
        super().bind(weights, grads, accumulating)
        for name, part in (("fc", self.fc), ("proj", self.proj)):
            part.bind({k: weights[f"{name}.{k}"] for k, _ in part.params},
                      {k: grads[f"{name}.{k}"] for k, _ in part.params})

    def forward(self, be, x):
        h, _ = self.fc.forward(be, x)
        a = be.empty(h.shape)
        be.gelu_forward(h, a)
        y, _ = self.proj.forward(be, a)
        be.add_(y, x)  # the residual
        return y, (x, h, a)

    def backward(self, be, dout, saved, accumulate=False, need_dinp=True):
        x, h, a = saved
        da = self.proj.backward(be, dout, a, accumulate=accumulate)
        dh = be.empty(h.shape)
        be.gelu_backward(h, da, dh)
        dx = self.fc.backward(be, dh, x, accumulate=accumulate, need_dinp=need_dinp)
        if dx is not None:
            be.add_(dx, dout)  # the residual's gradient
        return dx


register_layer("resmlp", ResidualMLP, keys={"dim": int, "hidden": int, "init_scale": float},
               required=("dim", "hidden"), defaults={"init_scale": 1.0})

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jobs", "configs", "digits.toml")
LAYERS = ('[{type = "linear", in = 64, out = 128}, {type = "relu"}, {type = "resmlp", dim = 128, hidden = 256}, '
          '{type = "linear", in = 128, out = 10}]')


def main():
    from hpctrain import Trainer, load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    p.add_argument("--out", default="runs/examples/resmlp", help="folder for checkpoints and metrics")
    args = p.parse_args()
    out = os.path.abspath(args.out)
    cfg = load_config(CONFIG, [f"model.layers={LAYERS}", f"train.steps={args.steps}",
                               f"train.eval_every={args.steps}", f'checkpoint.dir="{out}"',
                               f'train.metrics="{out}/metrics.jsonl"'])
    trainer = Trainer(cfg)  # collective over COMM_WORLD, as in examples/train_digits.py
    try:
        last = trainer.run()
    finally:
        trainer.close()
    if trainer.rank0:
        print(f"done: val_accuracy {last.get('val_accuracy', float('nan')):.3f}; checkpoints in {out}")


if __name__ == "__main__":
    main()
