"""Layers of your own (hpctrain/layer_kinds.py, examples/custom_layer.py): registered by name, checked like the
built-in kinds, exact gradients, trained by the Trainer, recorded in checkpoints and read back by the command line
given ``--plugin``. Multi-rank layouts: tests/mpi/test_custom_layer.py."""

import os
import subprocess
import sys

import numpy as np
import pytest

import reference as ref
from helpers import config, make_classification
from hpctrain.backend.cpu import CpuBackend
from hpctrain.errors import ConfigError
from hpctrain.layer_kinds import plugin_modules, register_layer
from hpctrain.nn import make_model
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer
from test_ops import numeric_grad

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import custom_layer  # noqa: E402  (registers "resmlp")

LAYERS = [{"type": "linear", "in": 6, "out": 8}, {"type": "tanh"}, {"type": "resmlp", "dim": 8, "hidden": 12},
          {"type": "linear", "in": 8, "out": 3}]


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


class ReferenceBackend:
    """The kernels the residual block calls, in float64 numpy (tests/reference.py): central differences at 1e-6
    check the block's own chain rule, apart from float32 rounding."""

    def empty(self, shape, dtype=np.float64):
        return np.empty(shape, np.float64)

    def matmul_nt(self, x, w, out, bias=None):
        out[...] = ref.linear_forward(x, w, bias)

    def matmul_nn(self, dout, w, out):
        out[...] = dout @ w

    def matmul_tn(self, dout, x, out, accumulate=False):
        out[...] = (out if accumulate else 0) + dout.T @ x

    def bias_grad(self, dout, out, accumulate=False):
        out[...] = (out if accumulate else 0) + dout.sum(axis=0)

    def gelu_forward(self, x, out):
        out[...] = ref.gelu(x)

    def gelu_backward(self, x, dout, dinp):
        dinp[...] = ref.gelu_backward(x, dout)

    def add_(self, out, x):
        out += x


def block_loss_and_grads(be, layer, weights, x, R, dtype):
    """sum(forward(x) · R), the input gradient and the parameter gradients, through ``be``."""
    w = {k: v.astype(dtype) for k, v in weights.items()}
    grads = {k: np.zeros_like(v) for k, v in w.items()}
    layer.bind(w, grads)
    out, saved = layer.forward(be, x.astype(dtype))
    dx = layer.backward(be, R.astype(dtype), saved)
    return float((out.astype(np.float64) * R).sum()), dx, grads


def test_the_residual_block_has_exact_gradients():
    """Finite differences of sum(forward · R) against backward for x and every parameter (float64 reference
    kernels); the CPU backend's float32 kernels give the same to float32 rounding."""
    rng = np.random.default_rng(0)
    layer = custom_layer.ResidualMLP(4, 6)
    weights = {k: v.astype(np.float64) for k, v in layer.init(rng).items()}
    x, R = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    be = ReferenceBackend()
    _, dx, grads = block_loss_and_grads(be, layer, weights, x, R, np.float64)
    np.testing.assert_allclose(dx, numeric_grad(lambda v: block_loss_and_grads(be, layer, weights, v, R,
                                                                                np.float64)[0], x.copy()),
                               rtol=1e-6, atol=1e-9)
    for name in weights:
        def f(v, name=name):
            return block_loss_and_grads(be, layer, {**weights, name: v}, x, R, np.float64)[0]
        np.testing.assert_allclose(grads[name], numeric_grad(f, weights[name].copy()), rtol=1e-6, atol=1e-9,
                                   err_msg=name)
    _, dx32, grads32 = block_loss_and_grads(CpuBackend(), layer, weights, x, R, np.float32)
    np.testing.assert_allclose(dx32, dx, rtol=1e-5, atol=1e-5)
    for name in weights:
        np.testing.assert_allclose(grads32[name], grads[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_registration_refuses_what_a_config_could_not_use():
    with pytest.raises(ConfigError, match="'linear' is a built-in layer kind"):
        register_layer("linear", custom_layer.ResidualMLP)
    with pytest.raises(ConfigError, match="lower-case letters"):
        register_layer("Res-MLP", custom_layer.ResidualMLP)
    with pytest.raises(ConfigError, match="one of the types int, float, bool, str"):
        register_layer("badkeys", custom_layer.ResidualMLP, keys={"dim": list})
    with pytest.raises(ConfigError, match="'hidden' is required or defaulted but not in keys"):
        register_layer("badreq", custom_layer.ResidualMLP, keys={"dim": int}, required=("hidden",))
    with pytest.raises(ConfigError, match="'resmlp' is already registered by custom_layer"):
        register_layer("resmlp", lambda **kw: None)
    assert register_layer("resmlp", custom_layer.ResidualMLP, keys={"dim": int, "hidden": int, "init_scale": float},
                          required=("dim", "hidden"), defaults={"init_scale": 1.0}).module == "custom_layer"


def test_a_registered_kinds_config_is_checked_like_a_built_in_one(tmp_path):
    make_classification(tmp_path / "d.h5")
    cfg = config(tmp_path / "d.h5", model={"layers": LAYERS})
    assert cfg.model.layers[2].as_dict() == {"type": "resmlp", "dim": 8, "hidden": 12, "init_scale": 1.0}
    bad = [({"dim": 8}, "a resmlp layer needs 'hidden'"), ({"dim": 8, "hidden": 12, "width": 3}, "unknown key 'width'"),
           ({"dim": 8, "hidden": 1.5}, r"model.layers\[2\].hidden: expected int"),
           ({"dim": 8, "hidden": 0}, "ValueError: dim and hidden must be >= 1"),
           ({"dim": 9, "hidden": 12}, r"model.layers\[2\].in = 9 does not match the previous output width 8")]
    for args, message in bad:
        layers = [*LAYERS[:2], {"type": "resmlp", **args}, LAYERS[3]]
        with pytest.raises(ConfigError, match=message):
            make_model(config(tmp_path / "d.h5", model={"layers": layers}).model)
    with pytest.raises(ConfigError, match=r"got 'swiglu' \(a kind of your own is registered by its module: hpctrain "
                                          r"--plugin MODULE"):
        config(tmp_path / "d.h5", model={"layers": [*LAYERS[:2], {"type": "swiglu"}, LAYERS[3]]})
    assert plugin_modules(cfg.to_toml()) == ["custom_layer"]


def test_it_trains_and_its_checkpoint_is_read_back_given_the_plugin(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ck = tmp_path / "ck"
    cfg = config(tmp_path / "d.h5", model={"layers": LAYERS}, train={"steps": 30, "eval_every": 30},
                 optim={"name": "adamw", "lr": 0.01}, checkpoint={"dir": str(ck), "every": 30})
    t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    last = t.run()
    t.close()
    assert last["val_accuracy"] > 0.9
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "examples"), ROOT]))
    env.pop("HPCTRAIN_PLUGINS", None)
    checkpoint = str(ck / "ckpt-00000030.h5")
    cli = [sys.executable, "-m", "hpctrain"]
    shown = subprocess.run(cli + ["inspect", checkpoint], env=env, capture_output=True, text=True, timeout=120)
    assert 'layer plugins: ["custom_layer"]' in shown.stdout, shown.stdout + shown.stderr
    refused = subprocess.run(cli + ["eval", checkpoint], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "got 'resmlp'" in refused.stderr and "--plugin MODULE" in refused.stderr
    for plugin in (["--plugin", "custom_layer"], []):
        given = dict(env, HPCTRAIN_PLUGINS="custom_layer") if not plugin else env
        ok = subprocess.run(cli + plugin + ["eval", checkpoint], env=given, capture_output=True, text=True,
                            timeout=120)
        assert ok.returncode == 0 and f"accuracy {last['val_accuracy']:.4f}" in ok.stdout, ok.stdout + ok.stderr
    missing = subprocess.run(cli + ["--plugin", "no_such_layers", "env"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "plugin no_such_layers: cannot import it (ModuleNotFoundError" in missing.stderr
