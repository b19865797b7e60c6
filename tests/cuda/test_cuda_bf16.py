"""``train.precision = "bf16"`` on the CUDA backend (backend/cuda/precision.py) against the CPU reference
(backend/cpu/precision.py): the rounding kernel bit for bit against ml_dtypes, each product and math attention
within one bfloat16 step of the reference (both round the same float32 values; the float32 sums before the
rounding may differ in their last bits, and a value that lands on a rounding boundary can then go the other
way), and a small GPT trained in bf16 on the device close to the CPU's bf16 run and far from fp32."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from cudatest import kept_qkv_backward, rand
from helpers import gpt_config, make_tokens
from hpctrain.backend.cpu.precision import Bf16CpuBackend, to_bf16
from hpctrain.backend.cuda.precision import Bf16CudaBackend
from hpctrain.errors import BackendError
from hpctrain.nn.dropout import DropoutKey
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer

ULP = 2.0 ** -7  # bfloat16's spacing relative to a value (8 significant bits)


@pytest.fixture(scope="module")
def bf16():
    return Bf16CudaBackend()


@pytest.fixture(scope="module")
def ref():
    return Bf16CpuBackend()


def near(got, want, frac=0.9):
    """Every element within one bfloat16 step of the reference's, most of them equal."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.abs(got - want) <= ULP * np.abs(want) + 1e-30), np.abs(got - want).max()
    assert np.mean(got == want) >= frac, np.mean(got == want)


def test_rounding_is_ml_dtypes_bit_for_bit(bf16):
    f32 = np.finfo(np.float32)
    special = np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 1.0078125, -1.0078125, 3.0e38, f32.max, -f32.max,
                        f32.tiny, f32.tiny / 3, np.inf, -np.inf, np.nan, -np.nan], np.float32)
    bits = np.array([0x7F800001, 0xFFC00001, 0x7FBFFFFF, 0x00008000, 0x00018000, 0x3F80FFFF], np.uint32)
    x = np.concatenate([special, bits.view(np.float32),
                        np.random.default_rng(0).standard_normal(999).astype(np.float32) * 1e3])
    with np.errstate(invalid="ignore"):  # the NaNs
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = bf16.to_host(bf16.round_bf16_(bf16.asarray(x)))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert got[~nan].tobytes() == want[~nan].tobytes()
    assert np.array_equal(np.signbit(got[nan]), np.signbit(want[nan]))
    out = bf16.empty(x.shape)
    bf16.round_bf16_(bf16.asarray(x), out)  # into another array, the input left as it was
    assert bf16.to_host(out)[~nan].tobytes() == want[~nan].tobytes()


def test_a_kept_operand_is_bfloat16_words_and_the_products_read_it_as_they_round(bf16, rng):
    """``product_input`` holds ml_dtypes' bfloat16 bits in uint16 words (half the bytes); a product of it computes
    the bits of the same product of the float32 array it came from, and a Linear keeps it for its backward."""
    from hpctrain.nn.layers import Linear

    x = rand(rng, 5, 7) * np.float32(1e3)
    kept = bf16.product_input(bf16.asarray(x))
    assert kept.dtype == np.uint16 and kept.nbytes == x.nbytes // 2
    assert bf16.to_host(kept).tobytes() == x.astype(ml_dtypes.bfloat16).tobytes()
    w = bf16.asarray(rand(rng, 3, 7))
    got, want = bf16.empty((5, 3)), bf16.empty((5, 3))
    bf16.matmul_nt(kept, w, got)
    bf16.matmul_nt(bf16.asarray(x), w, want)
    assert bf16.to_host(got).tobytes() == bf16.to_host(want).tobytes()
    lin = Linear(7, 3)
    lin.bind({k: bf16.asarray(v) for k, v in lin.init(rng).items()}, {"weight": bf16.empty((3, 7)),
                                                                        "bias": bf16.empty((3,))})
    _, saved = lin.forward(bf16, bf16.asarray(x))
    assert saved.dtype == np.uint16


@pytest.mark.parametrize("M,N,K", [(5, 7, 9), (17, 12, 33)])
def test_products_round_where_the_reference_rounds(bf16, ref, rng, M, N, K):
    a, w, bias, dy = rand(rng, M, K), rand(rng, N, K), rand(rng, N), rand(rng, M, N)
    for with_bias in (None, bias):
        out, want = bf16.empty((M, N)), np.empty((M, N), np.float32)
        bf16.matmul_nt(bf16.asarray(a), bf16.asarray(w), out, None if with_bias is None else bf16.asarray(bias))
        ref.matmul_nt(a, w, want, with_bias)
        near(bf16.to_host(out), want)
    out, want = bf16.empty((M, K)), np.empty((M, K), np.float32)
    bf16.matmul_nn(bf16.asarray(dy), bf16.asarray(w), out)
    ref.matmul_nn(dy, w, want)
    near(bf16.to_host(out), want)
    start = rand(rng, N, K)
    for accumulate in (False, True):
        out, want = bf16.asarray(start.copy()), start.copy()
        bf16.matmul_tn(bf16.asarray(dy), bf16.asarray(a), out, accumulate=accumulate)
        ref.matmul_tn(dy, a, want, accumulate=accumulate)
        near(bf16.to_host(out), want, frac=0.8 if accumulate else 0.9)
    plain = a @ w.T
    assert np.abs(to_bf16(plain) - plain).max() > 0  # the shapes above really round


@pytest.mark.parametrize("dropout", [None, 0.3])
def test_math_attention_rounds_where_the_reference_rounds(bf16, ref, rng, dropout):
    B, T, H, hs = 2, 5, 2, 3
    C = H * hs
    qkv, dout = rand(rng, B * T, 3 * C), rand(rng, B * T, C)
    draw = None if dropout is None else DropoutKey(1, 2, 3).attention(dropout, 4, T, 0, H, H)
    out, att, dqkv = bf16.empty((B * T, C)), bf16.empty((B, H, T, T)), bf16.empty((B * T, 3 * C))
    bf16.attention_forward(bf16.asarray(qkv), T, H, out, att, dropout=draw)
    bf16.attention_backward(bf16.asarray(dout), bf16.asarray(qkv), att, T, H, dqkv, dropout=draw)
    c_out, c_att, c_dqkv = (np.empty((B * T, C), np.float32), np.empty((B, H, T, T), np.float32),
                            np.empty((B * T, 3 * C), np.float32))
    ref.attention_forward(qkv, T, H, c_out, c_att, dropout=draw)
    ref.attention_backward(dout, qkv, c_att, T, H, c_dqkv, dropout=draw)
    np.testing.assert_allclose(bf16.to_host(att), c_att, rtol=4 * ULP, atol=1e-6)  # softmax of rounded scores
    near(bf16.to_host(out), c_out, frac=0.8)
    np.testing.assert_allclose(bf16.to_host(dqkv), c_dqkv, rtol=4 * ULP, atol=4 * ULP * np.abs(c_dqkv).max())


@pytest.mark.parametrize("kind", ["gelu", "relu"])
def test_an_activation_reads_its_kept_bfloat16_input_as_the_float32_values(bf16, ref, rng, kind):
    """``kept_output`` of a product's output (bfloat16 values) is uint16 words; ``<kind>_backward`` of them
    (``<kind>_backward_bf16``, widening as it reads) gives the bits of the float32 kernel on the same values, which
    are the CPU reference's within float32's error (the kernels' erf and exp are the GPU's); shapes and dtypes
    are checked in one line."""
    x = to_bf16(rand(rng, 7, 9) * np.float32(3))
    x[0, :3] = [0.0, -0.0, np.float32(2.0 ** -130)]  # zeros of both signs and a subnormal: exact in bfloat16
    dout = rand(rng, 7, 9)
    kept = bf16.kept_output(bf16.asarray(x))
    assert kept.dtype == np.uint16 and bf16.to_host(kept).tobytes() == x.astype(ml_dtypes.bfloat16).tobytes()
    got, want = bf16.empty(x.shape), bf16.empty(x.shape)
    getattr(bf16, f"{kind}_backward")(kept, bf16.asarray(dout), got)
    getattr(bf16, f"{kind}_backward")(bf16.asarray(x), bf16.asarray(dout), want)
    assert bf16.to_host(got).tobytes() == bf16.to_host(want).tobytes()
    cpu = np.empty_like(x)
    getattr(ref, f"{kind}_backward")(ref.kept_output(x), dout, cpu)
    np.testing.assert_allclose(bf16.to_host(got), cpu, rtol=1e-6, atol=1e-7)
    with pytest.raises(BackendError, match=rf"^{kind}_backward: x has shape \(7, 8\), expected \(7, 9\)"):
        getattr(bf16, f"{kind}_backward")(bf16.kept_output(bf16.empty((7, 8))), bf16.asarray(dout), got)


@pytest.mark.parametrize("residual", [False, True])
def test_layernorm_and_gelu_write_bfloat16_for_the_product_after_them(bf16, rng, residual):
    """Into ``empty_product_input`` (uint16 words) ``layernorm_forward`` (and its residual form) and
    ``gelu_forward`` write their float32 results rounded to bfloat16, ml_dtypes' bits of the float32 kernels'
    output; the statistics and the residual stream stay float32."""
    B, C = 6, 40
    x, res, w, b = rand(rng, B, C) * np.float32(3), rand(rng, B, C), rand(rng, C), rand(rng, C)
    outs = {}
    for kind in ("float32", "bf16"):
        xs = bf16.asarray(x.copy())
        out = bf16.empty((B, C)) if kind == "float32" else bf16.empty_product_input((B, C))
        mean, rstd = bf16.empty((B,)), bf16.empty((B,))
        if residual:
            bf16.residual_layernorm_forward(xs, bf16.asarray(res), bf16.asarray(w), bf16.asarray(b), 1e-5, out,
                                            mean, rstd)
        else:
            bf16.layernorm_forward(xs, bf16.asarray(w), bf16.asarray(b), 1e-5, out, mean, rstd)
        g = bf16.empty((B, C)) if kind == "float32" else bf16.empty_product_input((B, C))
        bf16.gelu_forward(bf16.asarray(x), g)
        outs[kind] = [bf16.to_host(a) for a in (out, g, mean, rstd, xs)]
    assert outs["bf16"][0].dtype == np.uint16
    for wide, words in zip(outs["float32"][:2], outs["bf16"][:2]):
        assert words.tobytes() == wide.astype(ml_dtypes.bfloat16).tobytes()
    for a, c in zip(outs["float32"][2:], outs["bf16"][2:]):
        assert a.tobytes() == c.tobytes()
    with pytest.raises(BackendError, match=r"^layernorm_forward: out must be float32, got int32"):
        bf16.layernorm_forward(bf16.asarray(x), bf16.asarray(w), bf16.asarray(b), 1e-5, bf16.empty((B, C), np.int32),
                               bf16.empty((B,)), bf16.empty((B,)))


def test_attention_reads_its_kept_bfloat16_qkv_as_the_float32_values(bf16, rng):
    """The q, k and v attention keeps (``product_input``: bfloat16 words) give the backward the bits that the
    float32 qkv they were rounded from gives it (the products round it the same)."""
    got, want, (qkv, out, att) = kept_qkv_backward(bf16, rng, T=5, H=2)
    assert got.tobytes() == want.tobytes()
    with pytest.raises(BackendError, match=r"^attention_forward: qkv must be float32, got uint16"):
        bf16.attention_forward(bf16.product_input(qkv), 5, 2, out, att)


def test_flash_attention_is_refused_in_one_line(bf16):
    with pytest.raises(BackendError, match=r'^model.attention = "flash" with train.precision = "bf16" is not built '):
        bf16.flash_attention_forward(None, 1, 1, None, None)


def _train(cfg, mesh, steps):
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    try:
        for step in range(steps):
            trainer.train_step(step, 0.01)
        return trainer.be.to_host(trainer.params.data).copy()
    finally:
        trainer.close()


def test_a_gpt_trains_in_bf16_on_the_device_as_on_the_cpu(tmp_path):
    """Three steps of a small GPT (dropout on, 2 micro-batches: the weight gradients accumulate): the device's bf16
    parameters are as close to the CPU reference's as rounding boundaries allow, and much further from fp32."""
    make_tokens(tmp_path / "t.h5", n=300)
    cfg = gpt_config(tmp_path / "t.h5", model={"block_size": 4, "n_embd": 8, "dropout": 0.1},
                     data={"val_fraction": 0.0}, cuda={"graphs": False},
                     train={"steps": 3, "batch_size": 4, "micro_batches": 2, "backend": "cuda", "grad_clip": 0.5,
                            "precision": "bf16"})
    mesh = Mesh()
    try:
        device = _train(cfg, mesh, 3)
        cpu = _train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, backend="cpu")), mesh, 3)
        fp32 = _train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="fp32")), mesh, 3)
    finally:
        mesh.free()
    apart, rounded = np.abs(device - cpu).max(), np.abs(fp32 - cpu).max()
    assert rounded > 1e-4
    assert apart <= rounded / 100, (apart, rounded)
