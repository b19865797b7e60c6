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

    def product_input(self, x):  # what a Linear keeps for its backward: x itself in full precision
        return x

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


class Scale(custom_layer.Layer):
    """A per-feature scale, y = x · s, written with numpy in place (as a user may): the base of the broken ones."""

    def __init__(self, dim: int):
        self.in_features = self.out_features = dim
        self.params = (("scale", (dim,)),)

    def init(self, rng):
        return {"scale": np.ones(self.in_features, np.float32)}

    def forward(self, be, x):
        out = be.empty(x.shape)
        np.multiply(x, self.w["scale"], out=out)
        return out, x

    def backward(self, be, dout, x, accumulate=False, need_dinp=True):
        g = (dout * x).sum(axis=0)
        self.g["scale"][...] = self.g["scale"] + g if accumulate else g
        return dout * self.w["scale"] if need_dinp else None


class WrongWidth(Scale):
    def forward(self, be, x):
        return x[:, :4].copy(), x


class WrongDtype(Scale):
    def forward(self, be, x):
        return (x * self.w["scale"]).astype(np.float64), x


class WrongGrad(Scale):
    def backward(self, be, dout, x, accumulate=False, need_dinp=True):
        super().backward(be, dout, x, accumulate, need_dinp)
        return dout[:, 1:].copy()


class WrongInit(Scale):
    def init(self, rng):
        return {"weight": np.ones(self.in_features, np.float32)}


class WrongInitShape(Scale):
    def init(self, rng):
        return {"scale": np.ones(self.in_features + 1, np.float32)}


class NoName(Scale):
    def __init__(self, dim: int):
        super().__init__(dim)
        self.params = (("", (dim,)),)


class TwiceNamed(Scale):
    def __init__(self, dim: int):
        super().__init__(dim)
        self.params = (("scale", (dim,)), ("scale", (dim,)))


def broken_model(tmp_path, kind, build):
    register_layer(kind, build, keys={"dim": int}, required=("dim",))
    make_classification(tmp_path / "d.h5", n=32)
    layers = [LAYERS[0], LAYERS[1], {"type": kind, "dim": 8}, LAYERS[3]]
    return config(tmp_path / "d.h5", model={"layers": layers}, train={"steps": 2, "eval_every": 0})


@pytest.mark.parametrize("kind, build, message", [
    ("wrongwidth", WrongWidth, r"forward returned its output as float32 \(8, 4\), expected float32 \(8, 8\)"),
    ("wrongdtype", WrongDtype, r"forward returned its output as float64 \(8, 8\), expected float32 \(8, 8\)"),
    ("wronggrad", WrongGrad, r"backward returned the input gradient as float32 \(8, 7\), expected float32 \(8, 8\)"),
    ("wronginit", WrongInit, r"init returned \['weight'\], but params declares \['scale'\]"),
    ("wronginitshape", WrongInitShape, r"init returned scale of shape \(9,\), but params declares \(8,\)"),
])
def test_a_registered_layer_that_breaks_the_contract_is_named_where_it_does(tmp_path, mesh, kind, build, message):
    """Its output, input gradient and initial tensors are checked as it hands them back (nn/checked.py): the error
    names the layer, its plugin and what it returned, not the next kernel (or, at a pipeline stage's boundary,
    nothing: a shorter message fits the receive buffer)."""
    cfg = broken_model(tmp_path, kind, build)
    with pytest.raises(ConfigError, match=rf"model.layers\[2\] \({kind}, plugin test_custom_layer\): {message}"):
        t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        try:
            t.run()
        finally:
            t.close()


@pytest.mark.parametrize("kind, build, message", [("noname", NoName, "'' is not a name"),
                                                  ("twicenamed", TwiceNamed, "a name repeats")])
def test_a_registered_layers_parameter_names_are_checked_with_its_config(tmp_path, kind, build, message):
    with pytest.raises(ConfigError, match=rf"model.layers\[2\]: {kind} layer \(test_custom_layer\): its params .*"
                                          rf"{message}"):
        broken_model(tmp_path, kind, build)


def test_a_layer_that_computes_with_numpy_in_place_trains_and_is_planned(tmp_path, mesh):
    """The memory plan's backend has no real arrays: a registered layer's own code does not run there (it is taken
    to keep its input), so a layer written with numpy is planned as it is trained."""
    from hpctrain.plan import plan

    cfg = broken_model(tmp_path, "scale", Scale)
    t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    t.run()
    t.close()
    assert plan(cfg, 1)[0].activation_bytes > 0


class NotALayer:
    """Everything user-guide.md lists, but not a subclass of hpctrain.nn.Layer."""

    def __init__(self, dim: int):
        self.in_features = self.out_features = dim
        self.params = (("scale", (dim,)),)

    def init(self, rng):
        return {"scale": np.ones(self.in_features, np.float32)}

    def forward(self, be, x):
        return x, None

    def backward(self, be, dout, saved, accumulate=False, need_dinp=True):
        return dout


def test_a_kind_that_builds_no_layer_is_refused_with_the_config(tmp_path):
    """It failed in the model's construction on a missing attribute (ties) with a raw traceback."""
    with pytest.raises(ConfigError, match=r"model.layers\[2\]: layer type 'notalayer' \(test_custom_layer\): build "
                                          r"returned a NotALayer, not a hpctrain.nn.Layer: subclass it"):
        broken_model(tmp_path, "notalayer", NotALayer)


def test_a_default_of_the_wrong_type_is_refused_at_registration():
    with pytest.raises(ConfigError, match=r"register_layer\('baddefault'\): the default of 'dim' must be int as its "
                                          r"key says, got 'big'"):
        register_layer("baddefault", Scale, keys={"dim": int}, defaults={"dim": "big"})
    assert register_layer("intdefault", Scale, keys={"dim": float}, defaults={"dim": 3}).defaults == {"dim": 3}


class OddScale(Scale):
    def __init__(self, dim: int):
        if dim % 2:
            raise ConfigError(f"dim must be even, got {dim}")
        super().__init__(dim)


def test_a_layers_own_config_error_keeps_its_place():
    register_layer("oddscale", OddScale, keys={"dim": int}, required=("dim",))
    with pytest.raises(ConfigError, match=r"model.layers\[0\]: oddscale layer \(test_custom_layer\): ConfigError: dim "
                                          r"must be even, got 3"):
        from hpctrain.config import parse_config

        parse_config({"model": {"layers": [{"type": "oddscale", "dim": 3}]},
                      "data": {"path": "d.h5", "inputs": "x", "targets": "y"}})
