"""train.precision: the CPU backend's bf16 reference (backend/cpu/precision.py) rounds every product's inputs and
output to bfloat16 and keeps the rest, and the master state, in float32; checkpoints move between precisions."""

import contextlib
import os

import ml_dtypes
import numpy as np
import pytest

import reference as ref
from helpers import gpt_config, make_tokens, run_trainer as run
from hpctrain.backend import get_backend
from hpctrain.backend.cpu import CpuBackend
from hpctrain.backend.cpu.precision import Bf16CpuBackend
from hpctrain.checkpoint import load_checkpoint
from hpctrain.errors import BackendError, ConfigError
from hpctrain.nn import make_loss
from hpctrain.nn.gpt import GPTSpec
from hpctrain.params import FlatBuffer

BF16 = ml_dtypes.bfloat16
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


def bf(x):
    """x rounded to bfloat16 (to nearest even), as float64."""
    return np.asarray(x, np.float32).astype(BF16).astype(np.float64)


def is_bf16(x) -> bool:
    return bool((np.asarray(x, np.float32).view(np.uint32) & 0xFFFF == 0).all())


def assert_bf16_result(got, exact):
    """got: the float32-accumulated product rounded to bfloat16; exact: the float64 product of the same rounded
    inputs, rounded to bfloat16. float32 accumulation may land on the other side of a rounding boundary, so a
    rare element is one bfloat16 step (2⁻⁸ relative) away; most are bitwise equal."""
    assert is_bf16(got)
    want = bf(exact)
    assert np.mean(got == want) > 0.95
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=0)


def test_linear_forward_and_backward_round_at_the_gemms():
    be = Bf16CpuBackend()
    rng = np.random.default_rng(0)
    B, K, N = 33, 70, 21
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((B, K), (N, K), (N,)))
    dy = rng.standard_normal((B, N)).astype(np.float32)
    out = np.empty((B, N), np.float32)
    be.matmul_nt(x, w, out, bias=b)
    assert_bf16_result(out, bf(x) @ bf(w).T + bf(b))
    assert np.abs(out - ref.linear_forward(x, w, b)).max() > 1e-3  # it does round
    dx = np.empty((B, K), np.float32)
    be.matmul_nn(dy, w, dx)
    assert_bf16_result(dx, bf(dy) @ bf(w))
    dw = np.ones((N, K), np.float32) * np.float32(0.1)
    be.matmul_tn(dy, x, dw, accumulate=True)  # a micro-batch's rounded gradient added to the float32 one
    np.testing.assert_allclose(dw - np.float32(0.1), bf(bf(dy).T @ bf(x)), rtol=2.0**-7, atol=1e-6)
    assert not is_bf16(dw)  # the accumulated gradient stays float32


def test_attention_products_round_and_softmax_stays_float32():
    """The math and flash paths agree in bf16 (the same rounded products), and both differ from float32."""
    be, fp = Bf16CpuBackend(), CpuBackend()
    rng = np.random.default_rng(1)
    B, T, H, C = 2, 5, 2, 8
    qkv = rng.standard_normal((B * T, 3 * C)).astype(np.float32)
    dout = rng.standard_normal((B * T, C)).astype(np.float32)
    results = {}
    for name, backend in (("bf16", be), ("fp32", fp)):
        out, att = np.empty((B * T, C), np.float32), np.empty((B, H, T, T), np.float32)
        backend.attention_forward(qkv, T, H, out, att)
        dqkv = np.empty_like(qkv)
        backend.attention_backward(dout, qkv, att, T, H, dqkv)
        fout, lse, fdqkv = np.empty_like(out), np.empty((B, H, T), np.float32), np.empty_like(qkv)
        backend.flash_attention_forward(qkv, T, H, fout, lse)
        backend.flash_attention_backward(dout, qkv, fout, lse, T, H, fdqkv)
        results[name] = out, dqkv, att, fout, fdqkv
    out, dqkv, att, fout, fdqkv = results["bf16"]
    assert is_bf16(out) and is_bf16(dqkv) and is_bf16(fout) and is_bf16(fdqkv)
    assert not is_bf16(att)  # the probabilities: softmax's float32 output
    np.testing.assert_allclose(fout, out, rtol=2.0**-7, atol=1e-6)
    np.testing.assert_allclose(fdqkv, dqkv, rtol=2.0**-6, atol=1e-3)
    want, _ = ref.attention(qkv, T, H)
    assert np.abs(out - want).max() > 1e-4 > np.abs(results["fp32"][0] - want).max()


def test_a_linear_keeps_its_input_in_bfloat16_and_computes_the_same_bits():
    """Under bf16 a Linear keeps the bfloat16 copy its products read (``product_input``: half the bytes, as autocast
    keeps the cast its matmul made); its output and gradients are the bits the products give the float32 input,
    which they round themselves. In fp32 it keeps the input itself."""
    from hpctrain.nn.layers import Linear

    rng = np.random.default_rng(1)
    B, K, N = 7, 12, 5
    x, dy = rng.standard_normal((B, K)).astype(np.float32), rng.standard_normal((B, N)).astype(np.float32)
    lin = Linear(K, N)
    w = lin.init(rng)
    assert CpuBackend().product_input(x) is x
    be = Bf16CpuBackend()
    g = {k: np.zeros_like(v) for k, v in w.items()}
    lin.bind(w, g)
    out, saved = lin.forward(be, x)
    assert saved.dtype == BF16 and saved.nbytes == x.nbytes // 2
    assert be.product_input(saved) is saved
    want = np.empty((B, N), np.float32)
    be.matmul_nt(x, w["weight"], want, bias=w["bias"])
    assert out.tobytes() == want.tobytes()
    dinp = lin.backward(be, dy, saved)
    dw, dx = np.empty((N, K), np.float32), np.empty((B, K), np.float32)
    be.matmul_tn(dy, x, dw)
    be.matmul_nn(dy, w["weight"], dx)
    assert g["weight"].tobytes() == dw.tobytes() and dinp.tobytes() == dx.tobytes()
    with pytest.raises(BackendError, match="matmul_nt: a must be float32, got float16"):
        be.matmul_nt(x.astype(np.float16), w["weight"], want)


def test_bf16_keeps_the_products_inputs_and_outputs_in_half_the_bytes_and_the_plan_counts_them(tmp_path):
    """A GPT's forward under bf16 keeps in bfloat16 each Linear's input (c_attn's, c_proj's, the MLP's two, the
    head's): 7·C of a block's kept values (ln_1 and ln_2 outputs, attention's, the GELU's 4·C) and the head's C;
    and the two products' outputs a block keeps for a backward other than the product's: the q, k and v attention
    reads (3·C) and the GELU's input (4·C). So 14·C a block and C at 2 bytes instead of 4 (the block's float32
    values left: the residual stream at ln_1 and ln_2, the probabilities, the LayerNorms' statistics).
    ``hpctrain plan``'s host activations go down by exactly that, less what a bf16
    product widens to float32 on the CPU beside the working set: the largest, the MLP's second Linear (its
    bfloat16 input [B·T, 4C], weight [C, 4C] and bias C as float32 copies)."""
    from hpctrain.parallel.executor import nbytes_of
    from hpctrain.plan import plan

    L, C, T, B = 2, 16, 8, 4
    spec = GPTSpec(vocab_size=12, block_size=T, n_layer=L, n_head=2, n_embd=C)
    idx = np.random.default_rng(0).integers(0, 12, (B, T)).astype(np.int64)
    kept = {}
    for name, be in (("fp32", CpuBackend()), ("bf16", Bf16CpuBackend())):
        part = _bound(be, spec, spec.init_params(0))[0]
        kept[name] = nbytes_of(part.forward(be, idx)[1])
    assert kept["fp32"] - kept["bf16"] == B * T * (L * 14 * C + C) * 2
    make_tokens(tmp_path / "t.h5", n=300)
    planned = {precision: plan(gpt_config(tmp_path / "t.h5", model={"block_size": T, "n_embd": C},
                                          train={"precision": precision}), 1)[0]
               for precision in ("fp32", "bf16")}
    widened = 4 * (B * T * 4 * C + 4 * C * C + C)
    assert planned["fp32"].activation_bytes - planned["bf16"].activation_bytes == \
        kept["fp32"] - kept["bf16"] - widened
    # and the products' bfloat16 copy of the parameters (backend/product_weights.py), held across steps
    assert planned["bf16"].params_bytes - planned["fp32"].params_bytes == 2 * spec.part().layout.size


def _bound(be, spec, params):
    """(part, parameters, gradients): the whole of ``spec`` on ``be``, its parameters ``params``."""
    part = spec.part()
    p, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
    part.bind(p, g)
    p.load_host_dict(params)
    return part, p, g


def _loss_and_grads(be, spec, params, idx, targets):
    """One forward and backward of the whole GPT on ``be``: (mean loss, gradients by name)."""
    part, p, g = _bound(be, spec, params)
    h, saved = part.forward(be, be.asarray(idx))
    n = idx.size
    value, _, d = make_loss("cross_entropy")(be, h, be.asarray(targets.reshape(-1)), 1.0 / n)
    part.backward(be, d, saved, need_dinp=False)
    return value / n, g.to_host_dict()


class _KeepsFloat32(Bf16CpuBackend):
    """The bf16 reference keeping what it keeps in float32: the products round their inputs themselves, and the
    LayerNorms and GELU before a product write float32."""

    def product_input(self, x):
        return x

    def empty_product_input(self, shape):
        return np.empty(shape, np.float32)


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_what_bf16_keeps_in_bfloat16_changes_no_bit(attention):
    """Keeping the Linears' inputs, attention's q, k, v and the GELU's input in bfloat16 rounds nothing a product
    would not round, and the GELU's input is c_fc's output, rounded already; the LayerNorms and the GELU writing
    their outputs rounded to bfloat16 (``empty_product_input``) round them as the products after them would: the
    loss and every gradient are the bits of the same backend keeping and writing them in float32, and what
    attention and the GELU keep is bfloat16 exactly."""
    L, C, T, B, V = 2, 16, 8, 3, 12
    spec = GPTSpec(vocab_size=V, block_size=T, n_layer=L, n_head=2, n_embd=C, attention=attention)
    rng = np.random.default_rng(5)
    idx, targets = (rng.integers(0, V, (B, T)).astype(np.int64) for _ in range(2))
    params = spec.init_params(3)
    got = _loss_and_grads(Bf16CpuBackend(), spec, params, idx, targets)
    want = _loss_and_grads(_KeepsFloat32(), spec, params, idx, targets)
    assert got[0] == want[0]
    assert all(got[1][k].tobytes() == want[1][k].tobytes() for k in want[1])
    be = _KeepsFloat32()
    part = _bound(be, spec, params)[0]
    saved = part.forward(be, idx)[1]
    for block in saved[1:-1]:
        qkv, gelu_input = block[2][0], block[6]
        assert qkv.shape == (B * T, 3 * C) and gelu_input.shape == (B * T, 4 * C)
        assert is_bf16(qkv) and is_bf16(gelu_input)
        assert block[1].dtype == block[5].dtype == block[7].dtype == np.float32  # ln_1's, ln_2's, the GELU's outputs
    be = Bf16CpuBackend()
    saved = _bound(be, spec, params)[0].forward(be, idx)[1]
    for block in saved[1:-1]:  # written as bfloat16 by the LayerNorm and the GELU, kept as they are
        assert block[1].dtype == block[5].dtype == block[7].dtype == BF16
    assert saved[-1][1].dtype == BF16  # ln_f's output, which the head keeps


class _RoundsEachProduct(Bf16CpuBackend):
    """The bf16 reference without the held copy of the weights: each product rounds its weight anew."""

    def product_weights(self, data, refresh):
        return contextlib.nullcontext()


def test_the_products_read_a_parts_weights_from_one_bfloat16_copy_rounded_at_each_forward():
    """Inside a part's passes the products read its weights from the backend's one bfloat16 copy of the flat
    parameters (backend/product_weights.py): rounded once a forward, not at all in the backward, the bits of
    rounding each weight at each product; parameters changed between passes are rounded again at the next
    forward, and outside a part's passes no product reads the copy."""
    L, C, T, B, V = 2, 16, 8, 3, 12
    spec = GPTSpec(vocab_size=V, block_size=T, n_layer=L, n_head=2, n_embd=C)
    rng = np.random.default_rng(7)
    idx, targets = (rng.integers(0, V, (B, T)).astype(np.int64) for _ in range(2))
    params = spec.init_params(4)
    got = _loss_and_grads(Bf16CpuBackend(), spec, params, idx, targets)
    want = _loss_and_grads(_RoundsEachProduct(), spec, params, idx, targets)
    assert got[0] == want[0] and all(got[1][k].tobytes() == want[1][k].tobytes() for k in want[1])

    be = Bf16CpuBackend()
    rounds = []
    be._round_into = lambda data, copy: (rounds.append(data.size), Bf16CpuBackend._round_into(data, copy))
    part, p, _ = _bound(be, spec, params)
    out, saved = part.forward(be, idx)
    assert rounds == [part.layout.size]
    assert be._held.copy.tobytes() == p.data.astype(BF16).tobytes() and be._held.copy.nbytes == p.data.nbytes // 2
    part.backward(be, np.ones_like(out), saved, need_dinp=False)
    assert rounds == [part.layout.size]  # the backward read the forward's copy
    w = p["transformer.h.0.mlp.c_fc.weight"]
    with be.product_weights(p.data, refresh=False):
        assert be._held_weight(w).tobytes() == w.astype(BF16).tobytes()
    assert be._held_weight(w) is None and len(rounds) == 1  # outside the part's passes: none
    p.load_host_dict({k: v * np.float32(1.5) for k, v in params.items()})
    out2, _ = part.forward(be, idx)
    assert len(rounds) == 2
    fresh = _RoundsEachProduct()
    part2 = _bound(fresh, spec, {k: v * np.float32(1.5) for k, v in params.items()})[0]
    assert out2.tobytes() == part2.forward(fresh, idx)[0].tobytes()


def test_an_mlp_keeps_an_activations_input_in_bfloat16_where_a_product_wrote_it():
    """An activation right after a Linear keeps its input as ``kept_output`` holds it (bfloat16 under bf16, the
    same bits of gradient); after a LayerNorm it stays float32, and so it does after a tensor-parallel pair's
    row-parallel Linear, whose output is a sum over the tp ranks."""
    from types import SimpleNamespace

    from hpctrain.config.sections import LayerSpec
    from hpctrain.nn.model import ModelSpec

    layers = [LayerSpec("linear", (("in", 6), ("out", 8))), LayerSpec("gelu"), LayerSpec("linear", (("in", 8),
              ("out", 8))), LayerSpec("relu"), LayerSpec("layernorm", (("dim", 8),)), LayerSpec("tanh"),
              LayerSpec("linear", (("in", 8), ("out", 3)))]
    spec = ModelSpec(layers)
    assert [getattr(l, "after_product", None) for l in spec.layers] == [None, True, None, True, None, False, None]
    assert spec.tp_pairs == [(0, 2)]
    split = [spec.tp_layer(i, SimpleNamespace(rank=0, size=2)) for i in range(len(layers))]
    assert split[1].after_product and not split[3].after_product
    be, wide = Bf16CpuBackend(), _KeepsFloat32()
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    grads = []
    for b in (be, wide):
        part, _, g = _bound(b, spec, spec.init_params(0))
        out, saved = part.forward(b, x)
        if b is be:
            assert [s.dtype for s in (saved[1], saved[3])] == [BF16, BF16] and saved[5].dtype == np.float32
        part.backward(b, np.ones_like(out), saved)
        grads.append(g.to_host_dict())
    assert all(grads[0][k].tobytes() == grads[1][k].tobytes() for k in grads[0])


def _sgd_run(step, params, steps=4, lr=0.3):
    """``steps`` of plain SGD on one batch from float32 ``params``: (the losses, the final parameters)."""
    p, losses = dict(params), []
    for _ in range(steps):
        loss, grads = step(p)
        losses.append(float(loss))
        p = {k: (p[k] - lr * grads[k]).astype(p[k].dtype) for k in p}
    return losses, p


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_bf16_gpt_really_rounds_and_still_learns(attention):
    """A few SGD steps of a small GPT: the bf16 run is at least 10x further from a float64 run than the float32 run
    is (it rounds), and its loss falls as the others' does."""
    spec = GPTSpec(vocab_size=12, block_size=8, n_layer=2, n_head=2, n_embd=16, attention=attention)
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 12, (4, 8)).astype(np.int64)
    targets = np.roll(idx, -1, axis=1)
    params = spec.init_params(0)
    _, exact = _sgd_run(lambda p: ref.gpt_loss_and_grads({k: v.astype(np.float64) for k, v in p.items()}, idx,
                                                         targets, n_layer=2, n_head=2),
                        {k: v.astype(np.float64) for k, v in params.items()})
    runs = {name: _sgd_run(lambda p, be=be: _loss_and_grads(be, spec, p, idx, targets), params)
            for name, be in (("fp32", CpuBackend()), ("bf16", Bf16CpuBackend()))}

    def distance(p):
        return max(float(np.abs(p[k] - exact[k]).max() / np.abs(exact[k]).max()) for k in exact)

    fp32, bf16 = distance(runs["fp32"][1]), distance(runs["bf16"][1])
    assert bf16 > 10 * fp32, (bf16, fp32)
    assert bf16 < 0.05, bf16  # still the same training
    losses = runs["bf16"][0]
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(v.dtype == np.float32 and not is_bf16(v) for v in runs["bf16"][1].values() if v.size > 8)


def test_bad_precision_fails_in_one_line():
    with pytest.raises(ConfigError, match=r"^train.precision: expected one of 'fp32', 'tf32', 'bf16', got 'fp16'$"):
        gpt_config("t.h5", train={"precision": "fp16"})
    assert gpt_config("t.h5").train.precision == "fp32"


def test_backend_choice_by_precision():
    lines = []
    assert type(get_backend("cpu", precision="bf16", log=lines.append)) is Bf16CpuBackend
    assert type(get_backend("cpu", precision="tf32", log=lines.append)) is CpuBackend
    assert type(get_backend("cpu", log=lines.append)) is CpuBackend
    assert lines == ['train.precision = "bf16": the CPU reference, every product rounded to bfloat16 with float32 '
                     "accumulation, the rest and the master weights float32",
                     'train.precision = "tf32": the CPU has no TF32, its products compute in float32']


@pytest.mark.parametrize("first,then", [("bf16", "fp32"), ("fp32", "bf16")])
def test_a_checkpoint_resumes_in_the_other_precision(tmp_path, mesh, first, then):
    """Checkpoints hold the float32 master: a run killed after step 2 resumes in the other precision, from the
    same float32 parameters the first precision's run had at step 2."""
    make_tokens(tmp_path / "t.h5")
    ckdir = str(tmp_path / "ck")

    def cfg(precision, steps, **checkpoint):
        return gpt_config(tmp_path / "t.h5", train={"steps": steps, "precision": precision}, checkpoint=checkpoint,
                          optim=SGD)  # AdamW would turn rounding where a gradient is ~0 into lr-sized steps

    two = run(cfg(first, 2), mesh)
    at_two = two.params.to_host_dict()
    run(cfg(first, 4, dir=ckdir, every=2), mesh)
    os.remove(os.path.join(ckdir, "ckpt-00000004.h5"))
    saved = load_checkpoint(os.path.join(ckdir, "ckpt-00000002.h5"), two.model.layout).params
    for name, value in at_two.items():
        assert saved[name].dtype == np.float32
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    assert not all(is_bf16(v) for v in at_two.values())  # the master is float32 in a bf16 run too
    lines = []
    resumed = run(cfg(then, 4, dir=ckdir), mesh, lines.append)
    assert any("ckpt-00000002.h5 at step 2" in line for line in lines), lines
    assert resumed.optim.step_count == 4
    straight = run(cfg(first, 4), mesh).params.to_host_dict()
    got = resumed.params.to_host_dict()
    worst = max(float(np.abs(got[k] - straight[k]).max() / np.abs(straight[k]).max()) for k in got)
    assert 0 < worst < 0.05, worst  # two steps in the other precision: rounding apart, the same training
