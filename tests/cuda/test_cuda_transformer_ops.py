"""Residual add, token + position embedding and causal attention kernels against numpy and the CPU backend.

The numpy references (tests/reference.py) are checked against finite differences
in tests/test_gpt_ops.py; here every CUDA kernel must match them and the CPU
backend. Shapes are odd and tiny; with the simulator's 16-thread blocks and
4-block grid cap some rows are wider than a block (C > 16, T > 16) and there are
more rows than blocks, so the strided loops run several rounds. The embedding
gradient is bit-identical to the CPU backend's (same float32 adds in the same
order) and run to run.
"""

import numpy as np
import pytest

import reference as ref
from cudatest import F32, rand
from hpctrain.backend.cuda import CudaBackend
from hpctrain.backend.dropout_mask import DropRows, dropout_reference, site_key
from hpctrain.nn.dropout import DropoutKey
from hpctrain.errors import BackendError

ATT_SHAPES = [(1, 1, 1, 1), (2, 5, 3, 2), (1, 7, 2, 4), (1, 18, 2, 3)]  # (B, T, H, hs)
EMB_SHAPES = [(1, 1, 1, 1, 1), (2, 5, 7, 4, 3), (3, 6, 6, 11, 20)]  # (B, T, Tmax, V, C)


def _ids(rng, B, T, V):
    idx = rng.integers(0, V, (B, T)).astype(np.int64)
    idx[0, 0] = V - 1  # the last row of the table, and repeats of it below
    idx[-1, -1] = V - 1
    return idx


# ----------------------------------------------------------------- residual add


@pytest.mark.parametrize("shape", [(1, 1), (5, 9), (6, 37), (2, 3, 5)])
def test_add(be, cpu, rng, shape):
    out, x = rand(rng, *shape), rand(rng, *shape)
    dev = be.asarray(out.copy())
    be.add_(dev, be.asarray(x))
    np.testing.assert_allclose(be.to_host(dev), out.astype(np.float64) + x, **F32)
    want = out.copy()
    cpu.add_(want, x)
    np.testing.assert_array_equal(be.to_host(dev), want)


def test_add_rejects_mismatched_and_host_arrays(be, cpu):
    with pytest.raises(BackendError, match=r"add_: x has shape \(3, 2\), expected \(2, 3\)"):
        be.add_(be.zeros((2, 3)), be.zeros((3, 2)))
    with pytest.raises(BackendError, match="add_: x must be a device array"):
        be.add_(be.zeros((2, 3)), np.zeros((2, 3), np.float32))


# ----------------------------------------------------------------- embedding


@pytest.mark.parametrize("B,T,Tmax,V,C", EMB_SHAPES)
def test_embedding_forward(be, cpu, rng, B, T, Tmax, V, C):
    idx, wte, wpe = _ids(rng, B, T, V), rand(rng, V, C), rand(rng, Tmax, C)
    out = be.empty((B * T, C))
    be.embedding_forward(be.asarray(idx), be.asarray(wte), be.asarray(wpe), out)
    np.testing.assert_allclose(be.to_host(out), ref.embedding(idx, wte, wpe), **F32)
    want = np.empty((B * T, C), np.float32)
    cpu.embedding_forward(idx, wte, wpe, want)
    np.testing.assert_array_equal(be.to_host(out), want)


@pytest.mark.parametrize("B,T,Tmax,V,C", EMB_SHAPES + [(2, 3, 5, 9, 4)])  # the last leaves most ids unused
@pytest.mark.parametrize("accumulate_wte,accumulate_wpe", [(False, False), (True, False), (False, True),
                                                           (True, True)])
def test_embedding_backward(be, cpu, rng, B, T, Tmax, V, C, accumulate_wte, accumulate_wpe):
    idx, dout = _ids(rng, B, T, V), rand(rng, B * T, C)
    start_wte, start_wpe = rand(rng, V, C), rand(rng, Tmax, C)
    dwte, dwpe = be.asarray(start_wte.copy()), be.asarray(start_wpe.copy())
    kw = dict(accumulate_wte=accumulate_wte, accumulate_wpe=accumulate_wpe)
    be.embedding_backward(be.asarray(dout), be.asarray(idx), dwte, dwpe, **kw)
    r_dwte, r_dwpe = ref.embedding_backward(dout, idx, V, Tmax)
    np.testing.assert_allclose(be.to_host(dwte), r_dwte + (start_wte if accumulate_wte else 0), **F32)
    np.testing.assert_allclose(be.to_host(dwpe), r_dwpe + (start_wpe if accumulate_wpe else 0), **F32)
    c_dwte, c_dwpe = start_wte.copy(), start_wpe.copy()
    cpu.embedding_backward(dout, idx, c_dwte, c_dwpe, **kw)
    np.testing.assert_array_equal(be.to_host(dwte), c_dwte)  # same float32 adds in the same order
    np.testing.assert_array_equal(be.to_host(dwpe), c_dwpe)


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_blocks_of_the_embedding_agree_with_the_cpu(be, cpu, rng, tp):
    """A vocab-parallel rank's block [lo, lo + n) of wte: ids outside it take zero rows, and only rank 0 adds the
    positions (nn/gpt.py: VocabParallelEmbedding); the gradient of the block's rows only."""
    from hpctrain.shards import row_block

    B, T, V, C = 2, 5, 11, 4
    idx, dout, wpe = _ids(rng, B, T, V), rand(rng, B * T, C), rand(rng, T, C)
    for r in range(tp):
        lo, n = row_block(V, tp, r)
        wte = rand(rng, n, C)
        kw = dict(vocab_start=lo, vocab=V)
        out, want = be.empty((B * T, C)), np.empty((B * T, C), np.float32)
        be.embedding_forward(be.asarray(idx), be.asarray(wte), be.asarray(wpe), out, add_positions=r == 0, **kw)
        cpu.embedding_forward(idx, wte, wpe, want, add_positions=r == 0, **kw)
        np.testing.assert_array_equal(be.to_host(out), want)
        dwte, dwpe = be.empty((n, C)), be.empty((T, C))
        c_dwte, c_dwpe = np.empty((n, C), np.float32), np.empty((T, C), np.float32)
        be.embedding_backward(be.asarray(dout), be.asarray(idx), dwte, dwpe, **kw)
        cpu.embedding_backward(dout, idx, c_dwte, c_dwpe, **kw)
        np.testing.assert_array_equal(be.to_host(dwte), c_dwte)
        np.testing.assert_array_equal(be.to_host(dwpe), c_dwpe)


def test_embedding_backward_is_deterministic(be, rng):
    idx = rng.integers(0, 3, (4, 16)).astype(np.int64)  # many repeats of each id
    dout = be.asarray(rand(rng, 4 * 16, 8, scale=1e3) + rand(rng, 4 * 16, 8, scale=1e-3))  # order-sensitive sums
    d_idx = be.asarray(idx)
    runs = []
    for _ in range(3):
        dwte, dwpe = be.empty((3, 8)), be.empty((16, 8))
        be.embedding_backward(dout, d_idx, dwte, dwpe)
        runs.append(be.to_host(dwte).tobytes() + be.to_host(dwpe).tobytes())
    assert len(set(runs)) == 1


@pytest.mark.parametrize("idx,message", [
    ([[0, 1], [5, 0]], r"token id 5 at position 2 of the batch is outside \[0, 4\)"),
    ([[0, -1], [5, 0]], r"token id -1 at position 1 of the batch is outside \[0, 4\)"),  # the first bad one
    ([[4, 4], [4, 4]], r"token id 4 at position 0 of the batch is outside \[0, 4\)"),
])
def test_embedding_rejects_ids_outside_the_table_like_cpu(be, cpu, rng, idx, message):
    idx = np.array(idx, np.int64)
    wte, wpe = rand(rng, 4, 3), rand(rng, 2, 3)
    with pytest.raises(BackendError, match=message) as dev_error:
        be.embedding_forward(be.asarray(idx), be.asarray(wte), be.asarray(wpe), be.empty((4, 3)))
    with pytest.raises(BackendError) as cpu_error:
        cpu.embedding_forward(idx, wte, wpe, np.empty((4, 3), np.float32))
    assert str(dev_error.value) == str(cpu_error.value)
    # the error is reported once: the next good batch goes through
    good = np.array([[3, 0], [1, 2]], np.int64)
    out = be.empty((4, 3))
    be.embedding_forward(be.asarray(good), be.asarray(wte), be.asarray(wpe), out)
    np.testing.assert_allclose(be.to_host(out), ref.embedding(good, wte, wpe), **F32)


def test_embedding_backward_rejects_ids_outside_the_table(be, rng):
    idx = be.asarray(np.array([[0, 1], [5, 0]], np.int64))
    with pytest.raises(BackendError, match=r"embedding_backward: token id 5 at position 2 .*outside \[0, 4\)"):
        be.embedding_backward(be.asarray(rand(rng, 4, 3)), idx, be.zeros((4, 3)), be.zeros((2, 3)))


def test_embedding_shape_errors_match_cpu(be, cpu, rng):
    idx, wte, wpe = np.zeros((2, 3), np.int64), rand(rng, 5, 4), rand(rng, 3, 4)
    cases = [  # (idx, wte, wpe, out shape, message)
        (idx, wte, wpe[:2], (6, 4), "position table wpe has 2 rows"),
        (idx, wte, rand(rng, 3, 5), (6, 4), r"wpe has shape \(3, 5\), expected 4 columns"),
        (idx, wte, wpe, (6, 5), r"out has shape \(6, 5\), expected \(6, 4\)"),
        (idx.astype(np.int32), wte, wpe, (6, 4), "idx must be int64, got int32"),
        (idx.reshape(-1), wte, wpe, (6, 4), "idx must have 2 dimensions"),
    ]
    for i, w, p, out_shape, message in cases:
        with pytest.raises(BackendError, match=message) as dev_error:
            be.embedding_forward(be.asarray(i), be.asarray(w), be.asarray(p), be.empty(out_shape))
        with pytest.raises(BackendError) as cpu_error:
            cpu.embedding_forward(i, w, p, np.empty(out_shape, np.float32))
        assert str(dev_error.value) == str(cpu_error.value)
    with pytest.raises(BackendError, match="embedding_forward: wte must be a device array"):
        be.embedding_forward(be.asarray(idx), wte, be.asarray(wpe), be.empty((6, 4)))
    dout = be.asarray(rand(rng, 6, 4))
    with pytest.raises(BackendError, match=r"embedding_backward: dout has shape \(6, 4\), expected \(4, 4\)"):
        be.embedding_backward(dout, be.asarray(np.zeros((2, 2), np.int64)), be.zeros((5, 4)), be.zeros((3, 4)))
    with pytest.raises(BackendError, match="embedding_backward: 3 positions but the position gradient dwpe has 2"):
        be.embedding_backward(dout, be.asarray(idx), be.zeros((5, 4)), be.zeros((2, 4)))


# ----------------------------------------------------------------- causal attention


@pytest.mark.parametrize("B,T,H,hs", ATT_SHAPES)
def test_attention_forward_backward(be, cpu, rng, B, T, H, hs):
    C = H * hs
    qkv, dout = rand(rng, B * T, 3 * C), rand(rng, B * T, C)
    d_qkv, d_dout = be.asarray(qkv), be.asarray(dout)
    out, att = be.empty((B * T, C)), be.empty((B, H, T, T))  # NaN under the simulator: all of it must be written
    be.attention_forward(d_qkv, T, H, out, att)
    r_out, r_att = ref.attention(qkv, T, H)
    np.testing.assert_allclose(be.to_host(out), r_out, **F32)
    np.testing.assert_allclose(be.to_host(att), r_att, **F32)
    c_out, c_att = np.empty((B * T, C), np.float32), np.empty((B, H, T, T), np.float32)
    cpu.attention_forward(qkv, T, H, c_out, c_att)
    np.testing.assert_allclose(be.to_host(out), c_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(be.to_host(att), c_att, rtol=1e-5, atol=1e-6)
    assert not np.triu(be.to_host(att), k=1).any()

    dqkv = be.asarray(np.full((B * T, 3 * C), 5.0, np.float32))  # overwritten, never accumulated
    be.attention_backward(d_dout, d_qkv, att, T, H, dqkv)
    first = be.to_host(dqkv)
    np.testing.assert_allclose(first, ref.attention_backward(dout, qkv, T, H), rtol=1e-5, atol=1e-5)
    c_dqkv = np.full((B * T, 3 * C), 5.0, np.float32)
    cpu.attention_backward(dout, qkv, c_att, T, H, c_dqkv)
    np.testing.assert_allclose(first, c_dqkv, rtol=1e-5, atol=1e-5)
    be.attention_backward(d_dout, d_qkv, att, T, H, dqkv)
    assert be.to_host(dqkv).tobytes() == first.tobytes()  # no atomics: bit-identical run to run


@pytest.mark.parametrize("rows", [DropRows(0.2, site_key(0, 1, 2)), DropRows(0.5, site_key(4, 0, 9), 31, 6, 15),
                                  DropRows(0.3, site_key(2, 2, 2), 9, 6, 12, causal=True)],
                         ids=["rows", "head-groups", "causal"])
@pytest.mark.parametrize("shape", [(1, 1), (12, 5), (3, 37)])
def test_dropout_is_the_cpu_draw_bit_for_bit(be, cpu, rng, rows, shape):
    x = rand(rng, *shape)
    out = be.empty(shape)
    be.dropout(be.asarray(x), out, rows)
    want = np.empty_like(x)
    cpu.dropout(x, want, rows)
    assert be.to_host(out).tobytes() == want.tobytes() == dropout_reference(x, rows).tobytes()
    dev = be.asarray(x)
    be.dropout(dev, dev, rows)  # in place
    assert be.to_host(dev).tobytes() == want.tobytes()


@pytest.mark.parametrize("B,T,H,hs", [(2, 5, 3, 2), (1, 18, 2, 3)])
def test_attention_with_dropout_agrees_with_the_cpu(be, cpu, rng, B, T, H, hs):
    """The draw over the probabilities in forward and again in backward, as the CPU backend's."""
    C = H * hs
    qkv, dout = rand(rng, B * T, 3 * C), rand(rng, B * T, C)
    draw = DropoutKey(1, 2, 3).attention(0.3, 4, T, 0, H, H)
    out, att, dqkv = be.empty((B * T, C)), be.empty((B, H, T, T)), be.empty((B * T, 3 * C))
    be.attention_forward(be.asarray(qkv), T, H, out, att, dropout=draw)
    be.attention_backward(be.asarray(dout), be.asarray(qkv), att, T, H, dqkv, dropout=draw)
    c_out, c_att, c_dqkv = (np.empty((B * T, C), np.float32), np.empty((B, H, T, T), np.float32),
                            np.empty((B * T, 3 * C), np.float32))
    cpu.attention_forward(qkv, T, H, c_out, c_att, dropout=draw)
    cpu.attention_backward(dout, qkv, c_att, T, H, c_dqkv, dropout=draw)
    np.testing.assert_allclose(be.to_host(out), c_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(be.to_host(att), c_att, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(be.to_host(dqkv), c_dqkv, rtol=1e-5, atol=1e-5)
    plain = be.empty((B * T, C))
    be.attention_forward(be.asarray(qkv), T, H, plain, be.empty((B, H, T, T)))
    assert np.abs(be.to_host(plain) - be.to_host(out)).max() > 1e-3  # the draw changed the output


# (B, T, H, hs, p): one thread per row (hs ≤ 16, 128 rows a block); four lanes of 10 channels a row, 32 rows a
# block, so T = 40 takes two row blocks; two lanes of 9 channels for hs = 17 (the last lane's last one unused);
# several key tiles of 16 (T > 16)
FLASH_CASES = [(2, 5, 3, 2, 0.0), (2, 9, 2, 4, 0.3), (1, 40, 1, 40, 0.0), (1, 35, 1, 17, 0.3)]


@pytest.mark.parametrize("B,T,H,hs,p", FLASH_CASES)
def test_flash_attention_agrees_with_the_cpu(be, cpu, rng, B, T, H, hs, p):
    """The fused kernels (backend/cuda/flash.py) against the CPU backend's flash path and the numpy reference: out, lse
    and dqkv (overwritten), with dropout's draw in forward and again in backward; bit-identical run to run."""
    C = H * hs
    qkv, dout = rand(rng, B * T, 3 * C), rand(rng, B * T, C)
    draw = DropoutKey(1, 2, 3).attention(p, 4, T, 1, H, 2 * H) if p else None
    d_qkv, d_dout = be.asarray(qkv), be.asarray(dout)
    out, lse = be.empty((B * T, C)), be.empty((B, H, T))  # NaN under the simulator: all of it must be written
    be.flash_attention_forward(d_qkv, T, H, out, lse, dropout=draw)
    c_out, c_lse = np.empty((B * T, C), np.float32), np.empty((B, H, T), np.float32)
    cpu.flash_attention_forward(qkv, T, H, c_out, c_lse, dropout=draw)
    np.testing.assert_allclose(be.to_host(out), c_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(be.to_host(lse), c_lse, rtol=1e-5, atol=1e-6)
    dqkv = be.asarray(np.full((B * T, 3 * C), 5.0, np.float32))
    be.flash_attention_backward(d_dout, d_qkv, out, lse, T, H, dqkv, dropout=draw)
    first = be.to_host(dqkv)
    c_dqkv = np.full((B * T, 3 * C), 5.0, np.float32)
    cpu.flash_attention_backward(dout, qkv, c_out, c_lse, T, H, c_dqkv, dropout=draw)
    np.testing.assert_allclose(first, c_dqkv, rtol=1e-5, atol=1e-5)
    if draw is None:
        np.testing.assert_allclose(be.to_host(out), ref.attention(qkv, T, H)[0], **F32)
        np.testing.assert_allclose(first, ref.attention_backward(dout, qkv, T, H), rtol=1e-5, atol=1e-5)
    be.flash_attention_backward(d_dout, d_qkv, out, lse, T, H, dqkv, dropout=draw)
    assert be.to_host(dqkv).tobytes() == first.tobytes()  # no atomics: bit-identical run to run


def test_flash_attention_refuses_heads_wider_than_its_kernels(be, rng):
    T, H, hs = 2, 1, 129
    with pytest.raises(BackendError, match=r'at most 128 channels \(n_embd / n_head = 129\).*model.attention = "math"'):
        be.flash_attention_forward(be.asarray(rand(rng, T, 3 * hs)), T, H, be.empty((T, hs)), be.empty((1, H, T)))


def test_attention_batch_longer_than_one_launch(be, rng, monkeypatch):
    """B·H batched products beyond CUDA's grid limit go in several launches (here: limit 2, 6 products)."""
    import hpctrain.backend.cuda.gemm as gemm

    monkeypatch.setattr(gemm, "MAX_GRID_Z", 2)
    B, T, H, hs = 2, 5, 3, 2
    C = H * hs
    qkv, dout = rand(rng, B * T, 3 * C), rand(rng, B * T, C)
    out, att, dqkv = be.empty((B * T, C)), be.empty((B, H, T, T)), be.empty((B * T, 3 * C))
    be.attention_forward(be.asarray(qkv), T, H, out, att)
    r_out, r_att = ref.attention(qkv, T, H)
    np.testing.assert_allclose(be.to_host(out), r_out, **F32)
    np.testing.assert_allclose(be.to_host(att), r_att, **F32)
    be.attention_backward(be.asarray(dout), be.asarray(qkv), att, T, H, dqkv)
    np.testing.assert_allclose(be.to_host(dqkv), ref.attention_backward(dout, qkv, T, H), rtol=1e-5, atol=1e-5)


def test_attention_shape_errors_match_cpu(be, cpu, rng):
    B, T, H, hs = 2, 3, 2, 2
    C = H * hs
    qkv, dout = rand(rng, B * T, 3 * C), rand(rng, B * T, C)
    forward_cases = [  # (qkv, T, n_head, out shape, att shape, message)
        (qkv, 4, H, (B * T, C), (B, H, T, T), "qkv has 6 rows, not a multiple of T = 4"),
        (qkv, 0, H, (B * T, C), (B, H, T, T), "not a multiple of T = 0"),
        (qkv[:, :11].copy(), T, H, (B * T, C), (B, H, T, T), "qkv has 11 columns; expected 3·C"),
        (qkv, T, 3, (B * T, C), (B, H, T, T), "divisible by n_head = 3"),
        (qkv, T, H, (B * T, C + 1), (B, H, T, T), r"out has shape \(6, 5\), expected \(6, 4\)"),
        (qkv, T, H, (B * T, C), (B, H, T, T + 1), r"att has shape \(2, 2, 3, 4\), expected \(2, 2, 3, 3\)"),
    ]
    for q, t, h, out_shape, att_shape, message in forward_cases:
        with pytest.raises(BackendError, match=message) as dev_error:
            be.attention_forward(be.asarray(q), t, h, be.empty(out_shape), be.empty(att_shape))
        with pytest.raises(BackendError) as cpu_error:
            cpu.attention_forward(q, t, h, np.empty(out_shape, np.float32), np.empty(att_shape, np.float32))
        assert str(dev_error.value) == str(cpu_error.value)
    att = be.empty((B, H, T, T))
    be.attention_forward(be.asarray(qkv), T, H, be.empty((B * T, C)), att)
    backward_cases = [  # (dout shape, att shape, dqkv shape, message)
        ((B * T, C + 1), (B, H, T, T), (B * T, 3 * C), r"dout has shape \(6, 5\), expected \(6, 4\)"),
        ((B * T, C), (B, H, T, T + 1), (B * T, 3 * C), r"att has shape \(2, 2, 3, 4\)"),
        ((B * T, C), (B, H, T, T), (B * T, C), r"dqkv has shape \(6, 4\), expected \(6, 12\)"),
    ]
    for dout_shape, att_shape, dqkv_shape, message in backward_cases:
        d, a = rand(rng, *dout_shape), rand(rng, *att_shape)
        with pytest.raises(BackendError, match=message) as dev_error:
            be.attention_backward(be.asarray(d), be.asarray(qkv), be.asarray(a), T, H, be.empty(dqkv_shape))
        with pytest.raises(BackendError) as cpu_error:
            cpu.attention_backward(d, qkv, a, T, H, np.empty(dqkv_shape, np.float32))
        assert str(dev_error.value) == str(cpu_error.value)
    with pytest.raises(BackendError, match="attention_forward: qkv must be a device array"):
        be.attention_forward(qkv, T, H, be.empty((B * T, C)), be.empty((B, H, T, T)))
    with pytest.raises(BackendError, match="attention_backward: dout must be a device array"):
        be.attention_backward(dout, be.asarray(qkv), att, T, H, be.empty((B * T, 3 * C)))


# ----------------------------------------------------------------- the GPU launch shapes in the simulator


def test_gpu_default_block_shape_runs(rng):
    """256-thread blocks, as on a GPU, on one small launch of each kernel."""
    be = CudaBackend(block=256, max_blocks=2)
    B, T, H, V, C = 1, 3, 2, 5, 4  # two heads of 2
    idx, wte, wpe, dout = _ids(rng, B, T, V), rand(rng, V, C), rand(rng, T, C), rand(rng, B * T, C)
    out = be.empty((B * T, C))
    be.embedding_forward(be.asarray(idx), be.asarray(wte), be.asarray(wpe), out)
    np.testing.assert_allclose(be.to_host(out), ref.embedding(idx, wte, wpe), **F32)
    dwte, dwpe = be.empty((V, C)), be.empty((T, C))
    be.embedding_backward(be.asarray(dout), be.asarray(idx), dwte, dwpe)
    r_dwte, r_dwpe = ref.embedding_backward(dout, idx, V, T)
    np.testing.assert_allclose(be.to_host(dwte), r_dwte, **F32)
    np.testing.assert_allclose(be.to_host(dwpe), r_dwpe, **F32)
    qkv = rand(rng, B * T, 3 * C)
    y, att, dqkv = be.empty((B * T, C)), be.empty((B, H, T, T)), be.empty((B * T, 3 * C))
    be.attention_forward(be.asarray(qkv), T, H, y, att)
    np.testing.assert_allclose(be.to_host(y), ref.attention(qkv, T, H)[0], **F32)
    be.attention_backward(be.asarray(dout), be.asarray(qkv), att, T, H, dqkv)
    np.testing.assert_allclose(be.to_host(dqkv), ref.attention_backward(dout, qkv, T, H), rtol=1e-5, atol=1e-5)
