"""Dropout (``model.dropout``): the counter-based mask against its definition, the CPU kernel bit for bit, attention
and the whole GPT with dropout against the float64 reference (itself checked by finite differences), the same draw
on every layout's share of a batch, dropout off outside training, and the config's bad values.

The CUDA kernels are checked against the CPU backend in tests/cuda/test_cuda_transformer_ops.py; every parallel
layout against one process in tests/mpi/test_gpt_parallel.py and tests/mpi/test_tensor_parallel.py.
"""

import math

import numpy as np
import pytest

import reference as ref
from helpers import gpt_config
from hpctrain.backend.cpu import CpuBackend
from hpctrain.backend.dropout_mask import (DropRows, dropout_reference, keep_reference, keep_scale, mix64, site_key,
                                           threshold)
from hpctrain.errors import BackendError, ConfigError
from hpctrain.nn import make_loss
from hpctrain.nn.dropout import DropoutKey
from hpctrain.nn.gpt import GPTSpec
from hpctrain.params import FlatBuffer
from hpctrain.train.step import _Batch
from test_ops import numeric_grad

SMALL = dict(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8)


@pytest.fixture(scope="module")
def be():
    return CpuBackend()


# ----------------------------------------------------------------- the mask


def test_the_numpy_mask_is_splitmix64_of_key_and_index():
    """One hash a pair of neighbouring indices: the even one's draw is its high half, the odd one's the low."""
    rows = DropRows(0.3, site_key(5, 7, 9))
    mask = keep_reference(rows, 3, 5)
    for r in range(3):
        for c in range(5):
            e = r * 5 + c
            bits = mix64(rows.key ^ (e >> 1))
            draw = bits & 0xFFFFFFFF if e & 1 else bits >> 32
            assert mask[r, c] == (draw >= threshold(0.3))


def test_a_causal_draw_keeps_nothing_above_each_blocks_diagonal(be):
    rows = DropRows(0.0, 5, 0, 8, 8, causal=True)
    x = np.ones((8, 4), np.float32)  # two 4 x 4 blocks
    be.dropout(x, x, rows)
    assert np.array_equal(x, np.vstack([np.tril(np.ones((4, 4)))] * 2))
    below = keep_reference(DropRows(0.5, 5), 8, 4) & keep_reference(rows._replace(p=0.5), 8, 4)
    assert np.array_equal(below, keep_reference(rows._replace(p=0.5), 8, 4))  # on and below: the plain draw


@pytest.mark.parametrize("p", [0.05, 0.2, 0.5, 0.9])
def test_the_dropped_share_is_p_and_the_mean_is_kept(be, p):
    x = np.ones((1000, 1000), np.float32)
    be.dropout(x, x, DropRows(p, site_key(1, 2, 3)))
    n, dropped = x.size, float((x == 0).mean())
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped - p) < 5 * sigma, (dropped, p)
    assert abs(float(x.mean(dtype=np.float64)) - 1.0) < 5 * sigma / (1 - p)
    assert set(np.unique(x)) == {0.0, keep_scale(p)}


def test_masks_change_with_seed_step_and_site_and_repeat_for_the_same_key():
    masks = [keep_reference(DropRows(0.5, site_key(*k)), 16, 16) for k in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1))]
    for i in range(4):
        for j in range(i + 1, 4):
            assert (masks[i] != masks[j]).mean() > 0.3
    assert np.array_equal(masks[0], keep_reference(DropRows(0.5, site_key(0, 0, 0)), 16, 16))


@pytest.mark.parametrize("rows", [DropRows(0.1, 12345), DropRows(0.5, site_key(3, 1, 4), 41),
                                  DropRows(0.25, site_key(0, 9, 2), 6, 4, 10), DropRows(0.0, 77),
                                  DropRows(0.3, site_key(1, 1, 1), 7, 6, 21, causal=True)],
                         ids=["plain", "odd-row0", "groups", "p0", "causal"])
def test_the_cpu_kernel_is_the_reference_bit_for_bit(be, rows):
    x = np.random.default_rng(0).standard_normal((12, 7)).astype(np.float32)
    out = np.full_like(x, np.nan)
    be.dropout(x, out, rows)
    assert out.tobytes() == dropout_reference(x, rows).tobytes()
    be.dropout(x, x, rows)  # in place
    assert x.tobytes() == out.tobytes()


def test_a_non_finite_value_stays_non_finite_where_dropped(be):
    x = np.full((4, 64), np.nan, np.float32)
    be.dropout(x, x, DropRows(0.5, 1))
    assert np.isnan(x).all()  # x · 0 is NaN: the non-finite checks still see it


def test_bad_arguments_are_backend_errors(be):
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(BackendError, match=r"dropout: p = 1.0 is outside \[0, 1\)"):
        be.dropout(x, x, DropRows(1.0, 0))
    with pytest.raises(BackendError, match=r"dropout: out has shape \(3, 2\), expected \(2, 3\)"):
        be.dropout(x, np.zeros((3, 2), np.float32), DropRows(0.5, 0))


# ----------------------------------------------------------------- the draw of a layout's share


def test_a_data_parallel_share_draws_its_slice_of_the_global_batch():
    """Samples 2..3 of a micro-batch starting at sample 2 draw what rows 2..3 of the whole batch draw."""
    T, C = 5, 6
    whole = keep_reference(DropoutKey(0, 4, 0).rows(0.5, 1, T), 4 * T, C)
    share = keep_reference(DropoutKey(0, 4, 2).rows(0.5, 1, T), 2 * T, C)
    assert np.array_equal(share, whole[2 * T:])


def test_a_tensor_parallel_rank_draws_its_heads_of_the_whole_attention():
    B, H, T = 2, 4, 3
    whole = keep_reference(DropoutKey(7, 1, 3).attention(0.5, 4, T, 0, H, H), B * H * T, T).reshape(B, H, T, T)
    for rank in range(2):
        mine = DropoutKey(7, 1, 3).attention(0.5, 4, T, 2 * rank, 2, H)
        got = keep_reference(mine, B * 2 * T, T).reshape(B, 2, T, T)
        assert np.array_equal(got, whole[:, 2 * rank : 2 * rank + 2])


def test_only_a_training_batch_has_a_key():
    rows = [np.arange(3), np.arange(3, 5)]
    assert _Batch(None, rows, 8).key(1) is None  # evaluation
    assert _Batch(None, rows, 8, dropout=(1, 9, 20)).key(1) == DropoutKey(1, 9, 23)


# ----------------------------------------------------------------- attention with dropout


def _factor(draw, shape):
    R = int(np.prod(shape[:-1]))
    return np.where(keep_reference(draw, R, shape[-1]), np.float64(keep_scale(draw.p)), 0.0).reshape(shape)


@pytest.mark.parametrize("B,T,H,hs", [(1, 1, 1, 1), (2, 5, 3, 2), (1, 7, 2, 4)])
def test_attention_with_dropout_against_the_reference(be, B, T, H, hs):
    rng = np.random.default_rng(1)
    C = H * hs
    qkv, dout = rng.standard_normal((B * T, 3 * C)).astype(np.float32), rng.standard_normal((B * T, C)).astype(np.float32)
    draw = DropoutKey(3, 2, 1).attention(0.4, 4, T, 0, H, H)
    drop = _factor(draw, (B, H, T, T))
    out, att, dqkv = np.empty((B * T, C), np.float32), np.empty((B, H, T, T), np.float32), np.empty_like(qkv)
    be.attention_forward(qkv, T, H, out, att, dropout=draw)
    r_out, r_att = ref.attention(qkv, T, H, drop)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(att, r_att, rtol=1e-5, atol=1e-6)  # kept undropped for the softmax's backward
    be.attention_backward(dout, qkv, att, T, H, dqkv, dropout=draw)
    np.testing.assert_allclose(dqkv, ref.attention_backward(dout, qkv, T, H, drop), rtol=1e-5, atol=1e-5)


def test_the_reference_attention_with_dropout_matches_finite_differences():
    rng = np.random.default_rng(4)
    B, T, H, hs = 2, 4, 2, 3
    qkv, c = rng.standard_normal((B * T, 6 * hs)), rng.standard_normal((B * T, 2 * hs))
    drop = _factor(DropRows(0.3, 99), (B, H, T, T))
    numeric = numeric_grad(lambda x: (c * ref.attention(x, T, H, drop)[0]).sum(), qkv)
    np.testing.assert_allclose(ref.attention_backward(c, qkv, T, H, drop), numeric, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------- the GPT with dropout


def _reference_drop(key, p, T, n_head):
    """The reference's factor at each site, from the same key the model draws from."""
    def drop(site, shape):
        if len(shape) == 4:
            draw = key.attention(p, site, T, 0, n_head, n_head)
        else:
            draw = key.rows(p, site, T)
        return _factor(draw, shape)
    return drop


def _model_grads(be, spec, params, idx, targets, key, *, split=False, recompute=False):
    part = spec.part()
    part.recompute = recompute
    p, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
    part.bind(p, g)
    p.load_host_dict(params)
    h, saved = part.forward(be, idx, key)
    n = idx.size
    value, _, d = make_loss("cross_entropy")(be, h, targets.reshape(-1), 1.0 / n)
    if split:  # the zero-bubble schedule's B then W
        _, wsaved = part.backward_input(be, d, saved, need_dinp=False)
        part.backward_weight(be, wsaved)
    else:
        part.backward(be, d, saved, need_dinp=False)
    return value / n, g.to_host_dict()


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_with_dropout_against_the_numpy_reference(be, bias):
    spec = GPTSpec(**SMALL, bias=bias, dropout=0.3)
    rng = np.random.default_rng(5)
    params = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.3 for k, v in spec.init_params(1).items()}
    idx = rng.integers(0, 11, (3, 6)).astype(np.int64)
    targets = rng.integers(0, 11, (3, 6)).astype(np.int64)
    key = DropoutKey(seed=2, step=5, sample0=4)
    value, grads = _model_grads(be, spec, params, idx, targets, key)
    want_value, want = ref.gpt_loss_and_grads(params, idx, targets, n_layer=2, n_head=2,
                                              drop=_reference_drop(key, 0.3, 6, 2))
    assert abs(value - want_value) < 1e-5 * abs(want_value)
    for name in want:
        err = np.abs(grads[name] - want[name]).max() / np.abs(want[name]).max()
        assert err < 2e-5, (name, err)
    plain_value, _ = ref.gpt_loss_and_grads(params, idx, targets, n_layer=2, n_head=2)
    assert abs(plain_value - want_value) > 1e-3  # the masks are there
    for split, recompute in ((True, False), (False, True)):  # the same draws in B/W and in a recomputed forward
        again = _model_grads(be, spec, params, idx, targets, key, split=split, recompute=recompute)[1]
        assert all(again[n].tobytes() == grads[n].tobytes() for n in grads)


def test_the_reference_gpt_with_dropout_matches_finite_differences():
    spec = GPTSpec(vocab_size=5, block_size=3, n_layer=1, n_head=2, n_embd=4)
    rng = np.random.default_rng(2)
    params = {k: v.astype(np.float64) + rng.standard_normal(v.shape) * 0.5 for k, v in spec.init_params(0).items()}
    idx, targets = rng.integers(0, 5, (2, 3)), rng.integers(0, 5, (2, 3))
    drop = _reference_drop(DropoutKey(0, 1, 0), 0.4, 3, 2)
    _, grads = ref.gpt_loss_and_grads(params, idx, targets, n_layer=1, n_head=2, drop=drop)
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight",
                 "transformer.h.0.attn.c_proj.bias", "transformer.h.0.mlp.c_proj.weight"):
        def f(x, name=name):
            return ref.gpt_loss_and_grads({**params, name: x}, idx, targets, n_layer=1, n_head=2, drop=drop)[0]
        np.testing.assert_allclose(grads[name], numeric_grad(f, params[name].copy()), rtol=1e-5, atol=1e-8,
                                   err_msg=name)


def test_without_a_key_the_model_does_not_drop(be):
    """Evaluation, sampling and prediction pass no key: the dropout model is the plain one bit for bit."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 11, (2, 6)).astype(np.int64)
    outs = []
    for p in (0.0, 0.5):
        part = GPTSpec(**SMALL, dropout=p).part()
        buf = FlatBuffer(be, part.layout)
        part.bind(buf, FlatBuffer(be, part.layout))
        buf.load_host_dict(part.init_params(0))
        outs.append(part.forward(be, idx)[0].copy())
    assert outs[0].tobytes() == outs[1].tobytes()


# ----------------------------------------------------------------- config


@pytest.mark.parametrize("p", [1.0, -0.1, 1.5])
def test_dropout_outside_zero_one_is_refused(tmp_path, p):
    with pytest.raises(ConfigError, match=rf"model.dropout: must be in \[0, 1\), got {p}"):
        gpt_config(tmp_path / "t.h5", model={"dropout": p})


def test_attention_is_a_gpt_key_of_two_choices(tmp_path):
    from hpctrain.config import config_to_toml, load_config, parse_config

    with pytest.raises(ConfigError, match=r"model.attention: expected one of 'math', 'flash', got 'sdpa'"):
        gpt_config(tmp_path / "t.h5", model={"attention": "sdpa"})
    with pytest.raises(ConfigError, match=r'model.attention: only used by kind = "gpt"'):
        parse_config({"model": {"layers": [{"type": "linear", "in": 2, "out": 2}], "attention": "flash"},
                      "data": {"path": "x.h5", "inputs": "x", "targets": "y"}})
    cfg = gpt_config(tmp_path / "t.h5", model={"attention": "flash"})
    (tmp_path / "c.toml").write_text(config_to_toml(cfg))
    assert load_config(tmp_path / "c.toml").model.attention == "flash"
    assert gpt_config(tmp_path / "t.h5").model.attention == "math"  # the default keeps the probabilities


def test_dropout_is_a_gpt_key(tmp_path):
    from hpctrain.config import config_to_toml, load_config, parse_config

    with pytest.raises(ConfigError, match=r'model.dropout: only used by kind = "gpt"'):
        parse_config({"model": {"layers": [{"type": "linear", "in": 2, "out": 2}], "dropout": 0.1},
                      "data": {"path": "x.h5", "inputs": "x", "targets": "y"}})
    cfg = gpt_config(tmp_path / "t.h5", model={"dropout": 0.2})
    (tmp_path / "c.toml").write_text(config_to_toml(cfg))
    assert load_config(tmp_path / "c.toml").model.dropout == 0.2
