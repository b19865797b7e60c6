"""The GPT model spec: nanoGPT's names and shapes, its initialisation, the golden forward/backward against
the numpy reference, parts chained as pipeline stages with the tied embedding, bad configs."""

import math

import numpy as np
import pytest

import reference as ref
from hpctrain.backend.cpu import CpuBackend
from hpctrain.errors import ConfigError
from hpctrain.nn import make_loss
from hpctrain.nn.gpt import GPTSpec
from hpctrain.params import FlatBuffer
from test_ops import numeric_grad

SMALL = dict(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8)


def nanogpt_shapes(V, T, L, C):
    """The state_dict of nanoGPT's GPT(bias=True) less lm_head.weight (tied) and the attn.bias mask buffers."""
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C)}
    for i in range(L):
        h = f"transformer.h.{i}."
        shapes.update({h + "ln_1.weight": (C,), h + "ln_1.bias": (C,), h + "attn.c_attn.weight": (3 * C, C),
                       h + "attn.c_attn.bias": (3 * C,), h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
                       h + "ln_2.weight": (C,), h + "ln_2.bias": (C,), h + "mlp.c_fc.weight": (4 * C, C),
                       h + "mlp.c_fc.bias": (4 * C,), h + "mlp.c_proj.weight": (C, 4 * C), h + "mlp.c_proj.bias": (C,)})
    shapes.update({"transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)})
    return shapes


def test_names_and_shapes_are_nanogpts():
    spec = GPTSpec(**SMALL)
    assert {s.name: s.shape for s in spec.layout} == nanogpt_shapes(11, 6, 2, 8)
    assert list(nanogpt_shapes(11, 6, 2, 8)) == spec.layout.names  # nanoGPT's state_dict order
    assert spec.units == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert spec.partition(2) == [(0, 1), (2, 3)]


def test_initialisation_follows_nanogpt():
    spec = GPTSpec(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=64)
    p = spec.init_params(0)
    assert abs(p["transformer.wte.weight"].std() - 0.02) < 0.002
    assert abs(p["transformer.h.0.attn.c_attn.weight"].std() - 0.02) < 0.002
    for name in ("attn.c_proj.weight", "mlp.c_proj.weight"):
        assert abs(p[f"transformer.h.3.{name}"].std() - 0.02 / math.sqrt(8)) < 0.001
    assert not p["transformer.h.1.mlp.c_fc.bias"].any()
    assert (p["transformer.ln_f.weight"] == 1).all() and not p["transformer.ln_f.bias"].any()
    assert all(a.dtype == np.float32 for a in p.values())


def _batch(spec, B, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, spec.vocab_size, (B, spec.block_size)).astype(np.int64)
    return idx, rng.integers(0, spec.vocab_size, (B, spec.block_size)).astype(np.int64)


def _run(be, spec, parts, params_full, idx, targets):
    """Forward through the parts in turn, the loss, backward in reverse; returns (loss, grads by name,
    summing a tied tensor's gradient over the parts that hold it, as the trainer does)."""
    loss = make_loss("cross_entropy")
    bufs = []
    for part in parts:
        p, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
        part.bind(p, g)
        p.load_host_dict({n: params_full[n] for n in part.layout.names})
        bufs.append(g)
    h, saved = be.asarray(idx), []
    for part in parts:
        h, s = part.forward(be, h)
        saved.append(s)
    n = idx.size
    value, _, d = loss(be, h, be.asarray(targets.reshape(-1)), 1.0 / n)
    for part, s in zip(reversed(parts), reversed(saved)):
        d = part.backward(be, d, s, need_dinp=not part.is_first)
    grads = {}
    for g in bufs:
        for name, arr in g.to_host_dict().items():
            grads[name] = grads[name] + arr if name in grads else arr
    return value / n, grads


@pytest.mark.parametrize("bias,attention", [(True, "math"), (False, "math"), (True, "flash")])
def test_golden_forward_and_backward_against_the_numpy_reference(bias, attention):
    be = CpuBackend()
    spec = GPTSpec(**SMALL, bias=bias, attention=attention)
    params = spec.init_params(1)
    # larger weights than the init, so every path carries signal
    rng = np.random.default_rng(5)
    params = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.3) for k, v in params.items()}
    idx, targets = _batch(spec, 3)
    value, grads = _run(be, spec, [spec.part()], params, idx, targets)
    want_value, want = ref.gpt_loss_and_grads(params, idx, targets, n_layer=2, n_head=2)
    assert abs(value - want_value) < 1e-5 * abs(want_value)
    assert set(grads) == set(want)
    for name in want:
        scale = np.abs(want[name]).max()
        err = np.abs(grads[name] - want[name]).max() / scale
        assert err < 2e-5, (name, err)  # float32 against float64


def test_reference_gpt_gradient_matches_finite_differences():
    spec = GPTSpec(vocab_size=5, block_size=3, n_layer=1, n_head=2, n_embd=4)
    rng = np.random.default_rng(2)
    params = {k: v.astype(np.float64) + rng.standard_normal(v.shape) * 0.5 for k, v in spec.init_params(0).items()}
    idx, targets = _batch(spec, 2)
    _, grads = ref.gpt_loss_and_grads(params, idx, targets, n_layer=1, n_head=2)
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight",
                 "transformer.h.0.ln_1.weight", "transformer.h.0.mlp.c_fc.bias", "transformer.ln_f.bias"):
        def f(x, name=name):
            return ref.gpt_loss_and_grads({**params, name: x}, idx, targets, n_layer=1, n_head=2)[0]
        np.testing.assert_allclose(grads[name], numeric_grad(f, params[name].copy()), rtol=1e-5, atol=1e-8,
                                   err_msg=name)


@pytest.mark.parametrize("stages", [[(0, 1), (2, 3)], [(0, 0), (1, 3)], [(0, 2), (3, 3)], [(0, 0), (1, 1), (2, 3)]])
def test_parts_chained_as_stages_equal_the_whole_model(stages):
    """The head's replica of wte on the last stage, summed with the embedding's, gives the whole model's gradient."""
    be = CpuBackend()
    spec = GPTSpec(**SMALL)
    params = spec.init_params(4)
    idx, targets = _batch(spec, 2, seed=1)
    whole_value, whole = _run(be, spec, [spec.part()], params, idx, targets)
    parts = [spec.part(lo, hi) for lo, hi in stages]
    assert parts[0].shared == ["transformer.wte.weight"] and parts[-1].replicas == ["transformer.wte.weight"]
    assert parts[-1].shared == ["transformer.wte.weight"]
    assert sum(p.owned_size for p in parts) == spec.layout.size
    value, grads = _run(be, spec, parts, params, idx, targets)
    assert value == whole_value
    for name in whole:  # the tied gradient adds in another order: float32 rounding only
        np.testing.assert_allclose(grads[name], whole[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_one_part_shares_the_tied_tensor_and_signals_it_last():
    be = CpuBackend()
    spec = GPTSpec(**SMALL)
    part = spec.part()
    assert part.replicas == [] and part.shared == [] and part.owned_size == part.layout.size
    p, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
    part.bind(p, g)
    p.load_host_dict(spec.init_params(0))
    idx, _ = _batch(spec, 1)
    out, saved = part.forward(be, idx)
    events = []
    part.backward(be, np.ones_like(out), saved, need_dinp=False, on_final=events.append)
    assert events == sorted(events, reverse=True) and events[-1] == 0
    assert events[0] == part.layout["transformer.ln_f.weight"].offset


def test_without_biases_the_names_are_nanogpts_bias_false_ones():
    spec = GPTSpec(**SMALL, bias=False)
    want = {k: v for k, v in nanogpt_shapes(11, 6, 2, 8).items() if not k.endswith(".bias")}
    assert {s.name: s.shape for s in spec.layout} == want
    assert set(spec.init_params(0)) == set(want)


def test_bad_shapes():
    with pytest.raises(ConfigError, match="n_embd = 10 is not divisible by model.n_head = 3"):
        GPTSpec(vocab_size=5, block_size=4, n_layer=1, n_head=3, n_embd=10)


def test_the_default_pipeline_cut_balances_flops_not_parameters():
    """GPT-2 small at pp = 2: the head's logits product (through the tied wte) is a large share of the time and
    the embedding's table almost none of it, so the cut is by FLOPs per token, not by parameters."""
    spec = GPTSpec(vocab_size=50257, block_size=256, n_layer=12, n_head=12, n_embd=768)
    C, V, T = 768, 50257, 256
    assert spec.flops(13, 13) == 2 * (2 * C) + 2 * C * V  # ln_f, then the logits
    assert spec.flops(1, 1) == 2 * (12 * C * C + 13 * C) + 2 * T * C  # a block's weights, biases, LayerNorms, attention
    stages = spec.partition(2)
    assert stages == [(0, 9), (10, 13)]
    costs = [spec.flops(lo, hi) for lo, hi in stages]
    assert max(costs) / sum(costs) < 0.55  # by parameters it was [(0, 3), (4, 13)]: 83% of the FLOPs on stage 1


def test_the_split_backward_leaves_the_tied_table_and_the_embedding_to_w():
    """Zero-bubble's B for the whole model writes no gradient of the token table or the positions (the head's
    dlogitsᵀ·h and the embedding's scatter-add are W's), and B then W gives ``backward``'s gradients bit for bit."""
    be = CpuBackend()
    spec = GPTSpec(**SMALL)
    idx, _ = _batch(spec, 2, seed=3)
    grads = []
    for split in (False, True):
        part = spec.part()
        p, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
        part.bind(p, g)
        p.load_host_dict(spec.init_params(0))
        g.load_host_dict({k: np.full(v.shape, np.nan, np.float32) for k, v in spec.init_params(0).items()})
        out, saved = part.forward(be, idx)
        dout = np.random.default_rng(4).standard_normal(out.shape).astype(np.float32)
        if split:
            _, wsaved = part.backward_input(be, dout, saved, need_dinp=False)
            after_b = g.to_host_dict()
            assert np.isnan(after_b["transformer.wte.weight"]).all() and np.isnan(after_b["transformer.wpe.weight"]).all()
            assert not np.isnan(after_b["transformer.ln_f.weight"]).any()  # LayerNorms write theirs in B
            part.backward_weight(be, wsaved)
        else:
            part.backward(be, dout, saved, need_dinp=False)
        grads.append(g.to_host_dict())
    for name, value in grads[0].items():
        assert not np.isnan(value).any() and np.array_equal(value, grads[1][name]), name
