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


def _nanogpt_get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """nanoGPT's train.py get_lr, as written there."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def test_nanogpt_schedule_is_get_lr_and_min_lr_ends_the_others():
    c = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100, schedule="nanogpt")
    for it in [0, 1, 50, 99, 100, 101, 2500, 4999, 5000, 5001, 6000]:
        assert lr_at(c, it, 5000) == pytest.approx(_nanogpt_get_lr(it, 1e-3, 1e-4, 100, 5000), rel=1e-12, abs=0)
    cos = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="cosine")
    assert lr_at(cos, 4, 14) == 1.0 and lr_at(cos, 14, 14) == pytest.approx(0.1)
    assert lr_at(cos, 9, 14) == pytest.approx(0.55)
    lin = OptimConfig(lr=1.0, min_lr=0.2, schedule="linear")
    assert lr_at(lin, 10, 10) == pytest.approx(0.2) and lr_at(lin, 5, 10) == pytest.approx(0.6)


def test_decay_min_ndim_decays_matrices_only():
    """optim.decay_min_ndim = 2, nanoGPT's configure_optimizers: biases and LayerNorm weights take no decay.
    With zero gradients AdamW's update is the decay alone: matrices shrink by 1 − lr·wd, vectors stay."""
    from hpctrain.optim import decay_runs

    layout = ParamLayout([("w1", (3, 4)), ("b1", (3,)), ("ln", (3,)), ("w2", (2, 3)), ("w3", (2, 2)), ("b3", (2,))])
    assert decay_runs(layout, 0, layout.size, 2, 0.1) == [(0, 12, 0.1), (12, 18, 0.0), (18, 28, 0.1),
                                                          (28, 30, 0.0)]
    assert decay_runs(layout, 5, 20, 2, 0.1) == [(5, 12, 0.1), (12, 18, 0.0), (18, 20, 0.1)]  # a ZeRO chunk
    assert decay_runs(layout, 0, layout.size, 0, 0.1) == [(0, 30, 0.1)]
    assert decay_runs(layout, 7, 7, 2, 0.1) == []
    be = CpuBackend()
    for pieces in (None, [(0, 13), (13, 30)]):
        params, grads = FlatBuffer(be, layout), FlatBuffer(be, layout)
        start = np.arange(1, layout.size + 1, dtype=np.float32)
        params.data[:] = start
        grads.data[:] = 0
        cfg = OptimConfig(name="adamw", lr=0.5, weight_decay=0.1, decay_min_ndim=2)
        Optimizer(cfg, be, params, grads, pieces=pieces).step(0.5)
        for spec in layout:
            want = start[spec.offset:spec.end] * (np.float32(1 - 0.5 * 0.1) if len(spec.shape) >= 2 else 1)
            np.testing.assert_allclose(params.data[spec.offset:spec.end], want, rtol=1e-6, err_msg=spec.name)


@pytest.mark.parametrize("cfg", [OptimConfig(name="sgd", lr=0.1), OptimConfig(name="sgd", lr=0.1, momentum=0.9),
                                 OptimConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                                 OptimConfig(name="adam", lr=0.01, weight_decay=0.1),
                                 OptimConfig(name="adamw", lr=0.01, weight_decay=0.1)],
                         ids=["sgd", "momentum", "nesterov", "adam", "adamw"])
def test_clipping_in_the_update_kernel_is_scaling_the_gradients_first(cfg):
    """step(lr, grad_scale=c) gives the bits of scale_(grads, c) then step(lr): the kernel multiplies each gradient
    by the same float32 factor as it reads it, without a pass of its own over the buffer (and leaves it)."""
    runs = []
    for folded in (False, True):
        local = np.random.default_rng(5)
        opt, params, grads = make(cfg)
        params.data[:] = local.standard_normal(params.data.size)
        for _ in range(3):
            grads.data[:] = local.standard_normal(grads.data.size) * 10
            kept = grads.data.copy()
            if folded:
                opt.step(0.1, grad_scale=0.37)
                assert np.array_equal(grads.data, kept)
            else:
                be.scale_(grads.data, 0.37)
                opt.step(0.1)
        runs.append(params.data.copy())
    assert runs[0].tobytes() == runs[1].tobytes()
