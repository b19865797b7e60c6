"""The transformer kernels (embedding, causal attention, residual add) on the CPU backend against the
numpy references, and the references' gradients against finite differences."""

import numpy as np
import pytest

import reference as ref
from hpctrain.backend.cpu import attention as cpu_attention
from hpctrain.backend.cpu import CpuBackend
from hpctrain.nn.dropout import DropoutKey
from hpctrain.errors import BackendError
from test_ops import numeric_grad

be = CpuBackend()
rng = np.random.default_rng(3)
F32 = dict(rtol=1e-5, atol=1e-6)


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("B,T,Tmax,V,C", [(1, 1, 1, 1, 1), (2, 5, 7, 4, 3), (3, 8, 8, 11, 6)])
def test_embedding_kernels(B, T, Tmax, V, C):
    idx = rng.integers(0, V, (B, T)).astype(np.int64)
    idx[0, 0] = V - 1  # repeated and extreme ids
    wte, wpe, dout = rand(V, C), rand(Tmax, C), rand(B * T, C)
    out = be.empty((B * T, C))
    be.embedding_forward(idx, wte, wpe, out)
    np.testing.assert_allclose(out, ref.embedding(idx, wte, wpe), **F32)
    dwte_ref, dwpe_ref = ref.embedding_backward(dout, idx, V, Tmax)
    dwte, dwpe = np.full((V, C), 7.0, np.float32), np.full((Tmax, C), 7.0, np.float32)  # overwritten
    be.embedding_backward(dout, idx, dwte, dwpe)
    np.testing.assert_allclose(dwte, dwte_ref, **F32)
    np.testing.assert_allclose(dwpe, dwpe_ref, **F32)
    be.embedding_backward(dout, idx, dwte, dwpe, accumulate_wte=True, accumulate_wpe=True)
    np.testing.assert_allclose(dwte, 2 * dwte_ref, **F32)
    np.testing.assert_allclose(dwpe, 2 * dwpe_ref, **F32)


def test_embedding_backward_is_deterministic():
    idx = rng.integers(0, 3, (16, 32)).astype(np.int64)  # many repeats of each id
    dout = rand(16 * 32, 8)
    runs = []
    for _ in range(3):
        dwte, dwpe = be.zeros((3, 8)), be.zeros((32, 8))
        be.embedding_backward(dout, idx, dwte, dwpe)
        runs.append(dwte.tobytes())
    assert len(set(runs)) == 1


def test_embedding_reference_gradient_matches_finite_differences():
    idx = np.array([[0, 2, 2], [1, 0, 2]])
    wte, wpe = rng.standard_normal((3, 2)), rng.standard_normal((4, 2))
    c = rng.standard_normal((6, 2))
    dwte, dwpe = ref.embedding_backward(c, idx, 3, 4)
    np.testing.assert_allclose(dwte, numeric_grad(lambda w: (c * ref.embedding(idx, w, wpe)).sum(), wte), rtol=1e-6)
    np.testing.assert_allclose(dwpe, numeric_grad(lambda p: (c * ref.embedding(idx, wte, p)).sum(), wpe), rtol=1e-6,
                               atol=1e-9)


def test_embedding_rejects_ids_outside_the_table():
    idx = np.array([[0, 1], [5, 0]], dtype=np.int64)
    with pytest.raises(BackendError, match=r"token id 5 at position 2 .*outside \[0, 4\)"):
        be.embedding_forward(idx, rand(4, 3), rand(2, 3), be.empty((4, 3)))
    with pytest.raises(BackendError, match="position table wpe has 1 rows"):
        be.embedding_forward(idx, rand(9, 3), rand(1, 3), be.empty((4, 3)))


@pytest.mark.parametrize("B,T,H,hs", [(1, 1, 1, 1), (2, 5, 3, 2), (3, 7, 2, 4), (1, 16, 4, 8)])
def test_attention_kernels(B, T, H, hs):
    C = H * hs
    qkv, dout = rand(B * T, 3 * C), rand(B * T, C)
    out, att = be.empty((B * T, C)), be.empty((B, H, T, T))
    be.attention_forward(qkv, T, H, out, att)
    out_ref, att_ref = ref.attention(qkv, T, H)
    np.testing.assert_allclose(out, out_ref, **F32)
    np.testing.assert_allclose(att, att_ref, **F32)
    dqkv = np.full((B * T, 3 * C), 5.0, np.float32)
    be.attention_backward(dout, qkv, att, T, H, dqkv)
    np.testing.assert_allclose(dqkv, ref.attention_backward(dout, qkv, T, H), rtol=1e-5, atol=1e-5)


def test_attention_is_causal():
    """Changing the last position changes no earlier output: nothing looks ahead."""
    B, T, H, hs = 2, 6, 2, 3
    qkv = rand(B * T, 3 * H * hs)
    out1, out2, att = be.empty((B * T, H * hs)), be.empty((B * T, H * hs)), be.empty((B, H, T, T))
    be.attention_forward(qkv, T, H, out1, att)
    qkv[T - 1] += 10.0
    qkv[2 * T - 1] += 10.0
    be.attention_forward(qkv, T, H, out2, att)
    keep = np.ones(B * T, bool)
    keep[[T - 1, 2 * T - 1]] = False
    np.testing.assert_array_equal(out1[keep], out2[keep])
    assert not np.allclose(out1[~keep], out2[~keep])


def test_attention_reference_gradient_matches_finite_differences():
    B, T, H = 2, 4, 2
    qkv = rng.standard_normal((B * T, 3 * 4))
    c = rng.standard_normal((B * T, 4))
    numeric = numeric_grad(lambda x: (c * ref.attention(x, T, H)[0]).sum(), qkv)
    np.testing.assert_allclose(ref.attention_backward(c, qkv, T, H), numeric, rtol=1e-5, atol=1e-8)


def test_attention_rejects_shapes_that_do_not_fit():
    with pytest.raises(BackendError, match="not a multiple of T = 4"):
        be.attention_forward(rand(6, 12), 4, 2, be.empty((6, 4)), be.empty((1, 2, 4, 4)))
    with pytest.raises(BackendError, match="divisible by n_head = 3"):
        be.attention_forward(rand(4, 12), 4, 3, be.empty((4, 4)), be.empty((1, 3, 4, 4)))


def _lse_reference(qkv, T, H):
    """log Σ_j≤i exp(q_i·k_j/√hs) per row, float64: the flash forward's kept statistic, [B, H, T]."""
    qkv = qkv.astype(np.float64)
    B, C = qkv.shape[0] // T, qkv.shape[1] // 3
    q, k = (qkv[:, i * C:(i + 1) * C].reshape(B, T, H, -1).transpose(0, 2, 1, 3) for i in range(2))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(C // H)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    return (mx + np.log(np.exp(s - mx).sum(axis=-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("B,T,H,hs", [(1, 1, 1, 1), (2, 5, 3, 2), (3, 7, 2, 4), (1, 16, 4, 8)])
@pytest.mark.parametrize("heads_at_once", [None, 1, 2])
def test_flash_attention_kernels(B, T, H, hs, heads_at_once, monkeypatch):
    """The flash path (lse kept, probabilities recomputed) against the numpy reference, taking the heads all at
    once and in chunks of one or two (the scratch budget made small)."""
    if heads_at_once:
        monkeypatch.setattr(cpu_attention, "FLASH_SCRATCH", 4 * T * T * heads_at_once)
    C = H * hs
    qkv, dout = rand(B * T, 3 * C), rand(B * T, C)
    out, lse = np.full((B * T, C), 3.0, np.float32), np.full((B, H, T), 3.0, np.float32)
    be.flash_attention_forward(qkv, T, H, out, lse)
    np.testing.assert_allclose(out, ref.attention(qkv, T, H)[0], **F32)
    np.testing.assert_allclose(lse, _lse_reference(qkv, T, H), **F32)
    dqkv = np.full((B * T, 3 * C), 5.0, np.float32)  # overwritten
    be.flash_attention_backward(dout, qkv, out, lse, T, H, dqkv)
    np.testing.assert_allclose(dqkv, ref.attention_backward(dout, qkv, T, H), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads_at_once", [None, 1, 2])
def test_flash_attention_with_dropout_is_the_math_path(heads_at_once, monkeypatch):
    """The same masks (a tensor-parallel rank's heads of a larger model: rows grouped and strided) whatever the
    chunking: the flash path equals the stored-probabilities path to float32 rounding."""
    B, T, H, hs = 3, 6, 3, 4
    if heads_at_once:
        monkeypatch.setattr(cpu_attention, "FLASH_SCRATCH", 4 * T * T * heads_at_once)
    draw = DropoutKey(seed=3, step=1, sample0=2).attention(0.3, 5, T, 3, H, 2 * H)
    C = H * hs
    qkv, dout = rand(B * T, 3 * C), rand(B * T, C)
    out, att, want = be.empty((B * T, C)), be.empty((B, H, T, T)), be.empty((B * T, 3 * C))
    be.attention_forward(qkv, T, H, out, att, dropout=draw)
    be.attention_backward(dout, qkv, att, T, H, want, dropout=draw)
    out2, lse, got = be.empty((B * T, C)), be.empty((B, H, T)), be.empty((B * T, 3 * C))
    be.flash_attention_forward(qkv, T, H, out2, lse, dropout=draw)
    be.flash_attention_backward(dout, qkv, out2, lse, T, H, got, dropout=draw)
    np.testing.assert_allclose(out2, out, **F32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (out != ref.attention(qkv, T, H)[0]).any()  # the mask dropped something


def test_flash_attention_rejects_shapes_that_do_not_fit():
    with pytest.raises(BackendError, match=r"lse has shape \(1, 2, 3\), expected \(1, 2, 4\)"):
        be.flash_attention_forward(rand(4, 12), 4, 2, be.empty((4, 4)), be.empty((1, 2, 3)))
    with pytest.raises(BackendError, match="not a multiple of T = 4"):
        be.flash_attention_backward(rand(6, 4), rand(6, 12), rand(6, 4), be.empty((1, 2, 4)), 4, 2, rand(6, 12))


def test_add():
    a, b = rand(3, 4), rand(3, 4)
    want = a + b
    be.add_(a, b)
    np.testing.assert_array_equal(a, want)
    with pytest.raises(BackendError):
        be.add_(a, rand(4, 3))
