"""Optimizer kernels against hand-written torch.optim steps, schedules and clipping."""

import math

import numpy as np
import pytest

import reference as ref
from hpctrain.backend.cpu import CpuBackend
from hpctrain.config import OptimConfig
from hpctrain.optim import Optimizer, clip_coefficient, lr_at
from hpctrain.params import FlatBuffer, ParamLayout

be = CpuBackend()
rng = np.random.default_rng(1)


def make(cfg):
    layout = ParamLayout([("0.weight", (3, 4)), ("0.bias", (3,))])
    params, grads = FlatBuffer(be, layout), FlatBuffer(be, layout)
    params.data[:] = rng.standard_normal(layout.size)
    return Optimizer(cfg, be, params, grads), params, grads


@pytest.mark.parametrize("momentum,nesterov,wd", [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 0.01),
                                                  (0.5, False, 0.1)])
def test_sgd_matches_torch_rule(momentum, nesterov, wd):
    opt, params, grads = make(OptimConfig(name="sgd", lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd))
    p, buf = params.data.astype(np.float64), np.zeros(params.data.size)
    for _ in range(3):
        grads.data[:] = rng.standard_normal(grads.data.size)
        p, buf = ref.sgd(p, grads.data, buf, 0.1, momentum, wd, nesterov)
        opt.step(0.1)
        np.testing.assert_allclose(params.data, p, rtol=1e-5, atol=1e-6)
    assert list(opt.slots) == (["momentum_buffer"] if momentum else [])


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_and_adamw_match_torch_rule(name):
    opt, params, grads = make(OptimConfig(name=name, lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1))
    p, m, v = params.data.astype(np.float64), np.zeros(params.data.size), np.zeros(params.data.size)
    for step in range(1, 4):
        grads.data[:] = rng.standard_normal(grads.data.size)
        p, m, v = ref.adam(p, grads.data, m, v, 0.01, 0.8, 0.99, 1e-8, 0.1, step, name == "adamw")
        opt.step(0.01)
        np.testing.assert_allclose(params.data, p, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(opt.slots["exp_avg"].data, m, rtol=1e-5, atol=1e-7)
    assert opt.step_count == 3


@pytest.mark.parametrize("beta2", [0.999, 0.99999])
def test_adam_one_minus_beta_is_computed_in_float64(beta2):
    """torch.optim computes 1 − β in double: in float32, 1 − 0.99999 is 1.0013e-5, 0.13% off, which
    moves the second moment and every step. Against a float64 reference, 10 steps stay at float32 noise."""
    opt, params, grads = make(OptimConfig(name="adam", lr=0.01, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0))
    p, m, v = params.data.astype(np.float64), np.zeros(params.data.size), np.zeros(params.data.size)
    for step in range(1, 11):
        grads.data[:] = rng.standard_normal(grads.data.size)
        p, m, v = ref.adam(p, grads.data, m, v, 0.01, 0.9, beta2, 1e-8, 0.0, step, False)
        opt.step(0.01)
    np.testing.assert_allclose(opt.slots["exp_avg_sq"].data, v, rtol=2e-6)
    np.testing.assert_allclose(params.data, p, rtol=2e-6, atol=2e-7)


def test_adam_first_step_by_hand():
    """Adam's first step moves each weight by lr·sign(g) (bias correction makes m̂/√v̂ = g/|g|)."""
    opt, params, grads = make(OptimConfig(name="adam", lr=0.5, weight_decay=0.0))
    before = params.data.copy()
    grads.data[:] = np.where(np.arange(grads.data.size) % 2, 2.0, -3.0)
    opt.step(0.5)
    np.testing.assert_allclose(params.data - before, -0.5 * np.sign(grads.data), rtol=1e-5)  # float32 rounding


def test_default_weight_decay_follows_torch():
    assert OptimConfig(name="adamw").weight_decay == 0.01
    assert OptimConfig(name="adam").weight_decay == 0.0
    assert OptimConfig(name="sgd").weight_decay == 0.0
    assert OptimConfig(name="adamw", weight_decay=0.0).weight_decay == 0.0


def test_schedules():
    c = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=4)
    assert [lr_at(c, s, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(c, 4, 14) == 1.0
    assert lr_at(c, 9, 14) == pytest.approx(0.5)
    assert lr_at(c, 14, 14) == pytest.approx(0.0)
    lin = OptimConfig(lr=2.0, schedule="linear")
    assert lr_at(lin, 5, 10) == pytest.approx(1.0)
    assert lr_at(OptimConfig(lr=0.3), 99, 100) == 0.3


def test_clip_coefficient_follows_clip_grad_norm():
    assert clip_coefficient(10.0, 0.0) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6))
    assert math.isclose(clip_coefficient(2.0, 1.0) * 2.0, 1.0, rel_tol=1e-6)
