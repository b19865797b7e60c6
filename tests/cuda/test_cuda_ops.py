"""Element-wise, reduction, LayerNorm, loss and optimizer kernels against numpy and the CPU backend.

The numpy references (tests/reference.py) are themselves checked against finite
differences in tests/test_ops.py; here every CUDA kernel must match them and the
CPU backend. Shapes are chosen so that, with the simulator's 16-thread blocks and
4-block grid cap, the grid-stride loops run several rounds (more than 64 elements,
more rows than blocks) and rows are wider than a block (C > 16).
"""

import numpy as np
import pytest

import reference as ref
from cudatest import AGREE, F32, rand
from hpctrain.backend.cuda import CudaBackend
from hpctrain.backend.cuda.gemm.tiled import GPU_TILE
from hpctrain.errors import BackendError

SHAPES = [(1, 1), (5, 9), (6, 37)]  # (B, C)


def _run_both(be, cpu, method, host_args, out_shapes, **kw):
    """Call ``method`` on both backends with the same inputs; return (cuda outputs, cpu outputs) as numpy."""
    dev_outs = [be.empty(s) for s in out_shapes]
    dev_args = [be.asarray(a) if np.ndim(a) else a for a in host_args]  # scalars (eps) stay on the host
    getattr(be, method)(*dev_args, *dev_outs, **kw)
    cpu_outs = [np.empty(s, np.float32) for s in out_shapes]
    getattr(cpu, method)(*host_args, *cpu_outs, **kw)
    return [be.to_host(o) for o in dev_outs], cpu_outs


# ----------------------------------------------------------------- activations, forward and backward


@pytest.mark.parametrize("B,C", SHAPES)
@pytest.mark.parametrize("name,forward,backward", [
    ("relu", ref.relu, ref.relu_backward),
    ("gelu", ref.gelu, ref.gelu_backward),
    ("tanh", np.tanh, lambda y, dout: ref.tanh_backward(y, dout)),
])
def test_activation_forward_backward(be, cpu, rng, B, C, name, forward, backward):
    x, dout = rand(rng, B, C, scale=2), rand(rng, B, C)
    (y,), (y_cpu,) = _run_both(be, cpu, f"{name}_forward", [x], [(B, C)])
    np.testing.assert_allclose(y, forward(x), **F32)
    np.testing.assert_allclose(y, y_cpu, **AGREE)
    saved = y_cpu if name == "tanh" else x  # Tanh's backward takes its output
    (dinp,), (dinp_cpu,) = _run_both(be, cpu, f"{name}_backward", [saved, dout], [(B, C)])
    np.testing.assert_allclose(dinp, backward(saved, dout), **F32)
    np.testing.assert_allclose(dinp, dinp_cpu, **AGREE)


# ----------------------------------------------------------------- bias gradient, layernorm


@pytest.mark.parametrize("B,C", SHAPES + [(0, 3)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_bias_grad(be, cpu, rng, B, C, accumulate):
    dout, start = rand(rng, B, C), rand(rng, C)
    dbias = be.asarray(start.copy())
    be.bias_grad(be.asarray(dout), dbias, accumulate=accumulate)
    expected = dout.astype(np.float64).sum(0) + (start if accumulate else 0)
    np.testing.assert_allclose(be.to_host(dbias), expected, **F32)
    want = start.copy()
    cpu.bias_grad(dout, want, accumulate=accumulate)
    np.testing.assert_allclose(be.to_host(dbias), want, **AGREE)


def test_column_sums_over_many_rows_split_into_row_groups_in_float64(be, cpu, rng):
    """Enough rows for several row groups (two waves of blocks): each group's float64 sum, added in order, gives
    the CPU backend's float64 column sums to float32 rounding, every run the same bits."""
    B, C = 1000, 5
    assert -(-B // (be._k.RY * 16)) > 1  # several row groups under the simulator's launch shapes
    dout = rand(rng, B, C) + np.float32(100.0)  # large sums of same-signed values: float32 accumulation drifts
    runs = []
    for _ in range(2):
        dbias = be.zeros((C,))
        be.bias_grad(be.asarray(dout), dbias)
        runs.append(be.to_host(dbias))
    want = np.zeros(C, np.float32)
    cpu.bias_grad(dout, want)
    np.testing.assert_array_equal(runs[0], dout.astype(np.float64).sum(0).astype(np.float32))
    np.testing.assert_array_equal(runs[0], want)
    assert runs[0].tobytes() == runs[1].tobytes()
    x, mean, rstd = rand(rng, B, C), rand(rng, B), np.abs(rand(rng, B)) + 1
    dw, db = be.zeros((C,)), be.zeros((C,))
    be.layernorm_backward(be.asarray(dout), be.asarray(x), be.asarray(rand(rng, C)), be.asarray(mean),
                          be.asarray(rstd), be.empty((B, C)), dw, db)
    n = ((x.astype(np.float64) - mean[:, None]) * rstd[:, None]).astype(np.float32)  # as the kernel rounds it
    np.testing.assert_allclose(be.to_host(dw), (dout * n).astype(np.float64).sum(0), rtol=1e-6)
    np.testing.assert_array_equal(be.to_host(db), dout.astype(np.float64).sum(0).astype(np.float32))


@pytest.mark.parametrize("B,C", SHAPES)
def test_layernorm_forward_backward(be, cpu, rng, B, C):
    eps = 1e-5
    x, w, b, dout = rand(rng, B, C, scale=3) + 1, rand(rng, C), rand(rng, C), rand(rng, B, C)
    (out, mean, rstd), cpu_outs = _run_both(be, cpu, "layernorm_forward", [x, w, b, np.float32(eps)],
                                            [(B, C), (B,), (B,)])
    r_out, r_mean, r_rstd = ref.layernorm(x, w, b, eps)
    np.testing.assert_allclose(out, r_out, **F32)
    np.testing.assert_allclose(mean, r_mean, **F32)
    np.testing.assert_allclose(rstd, r_rstd, rtol=1e-5)
    for got, want in zip((out, mean, rstd), cpu_outs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)

    start_w, start_b = rand(rng, C), rand(rng, C)
    r_dinp, r_dw, r_db = ref.layernorm_backward(dout, x, w, eps)
    for accumulate in (False, True):
        dinp, dw, db = be.empty((B, C)), be.asarray(start_w.copy()), be.asarray(start_b.copy())
        be.layernorm_backward(be.asarray(dout), be.asarray(x), be.asarray(w), be.asarray(mean), be.asarray(rstd),
                              dinp, dw, db, accumulate=accumulate)
        np.testing.assert_allclose(be.to_host(dinp), r_dinp, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(be.to_host(dw), r_dw + (start_w if accumulate else 0), **F32)
        np.testing.assert_allclose(be.to_host(db), r_db + (start_b if accumulate else 0), **F32)
        c_dinp, c_dw, c_db = np.empty((B, C), np.float32), start_w.copy(), start_b.copy()
        cpu.layernorm_backward(dout, x, w, mean, rstd, c_dinp, c_dw, c_db, accumulate=accumulate)
        np.testing.assert_allclose(be.to_host(dinp), c_dinp, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(be.to_host(dw), c_dw, rtol=1e-5, atol=2e-6)


# ----------------------------------------------------------------- losses


@pytest.mark.parametrize("B,C", [(1, 1), (5, 9), (6, 37)])
def test_cross_entropy(be, cpu, rng, B, C):
    logits = rand(rng, B, C, scale=3)
    targets = rng.integers(0, C, B).astype(np.int64)
    targets[0] = logits[0].argmax()  # at least one correct row
    scale = 1.0 / B
    dlogits = be.empty((B, C))
    total, correct = be.cross_entropy(be.asarray(logits), be.asarray(targets), dlogits, scale)
    r_total, r_correct, r_grad = ref.cross_entropy(logits, targets)
    assert isinstance(total, float) and isinstance(correct, int)
    np.testing.assert_allclose(total, r_total, rtol=1e-5)
    assert correct == r_correct
    np.testing.assert_allclose(be.to_host(dlogits), r_grad * scale, **F32)
    c_grad = np.empty((B, C), np.float32)
    c_total, c_correct = cpu.cross_entropy(logits, targets, c_grad, scale)
    np.testing.assert_allclose(total, c_total, rtol=1e-6)
    assert correct == c_correct
    np.testing.assert_allclose(be.to_host(dlogits), c_grad, **AGREE)


@pytest.mark.parametrize("B,V,lo,vocab", [(1, 1, 0, 1), (5, 9, 4, 13), (6, 37, 0, 40), (3, 4, 0, 4)])
def test_vocab_parallel_cross_entropy_passes_agree_with_the_cpu(be, cpu, rng, B, V, lo, vocab):
    """The three passes over a block of columns [lo, lo + V) (nn/loss.py: VocabParallelCrossEntropy)."""
    logits = rand(rng, B, V, scale=3)
    if V >= 4:
        logits[-1, 1] = logits[-1, 3] = logits[-1].max() + 1  # a tie: the first column wins
    targets = rng.integers(0, vocab, B).astype(np.int64)
    targets[0] = lo  # at least one target in the block
    kw = dict(vocab_start=lo, vocab=vocab)
    dev = [be.empty((B,)), be.empty((B,), np.int64), be.empty((B,))]
    host = [np.empty(B, np.float32), np.empty(B, np.int64), np.empty(B, np.float32)]
    be.ce_shard_stats(be.asarray(logits), be.asarray(targets), *dev, **kw)
    cpu.ce_shard_stats(logits, targets, *host, **kw)
    for d, h in zip(dev, host):
        np.testing.assert_array_equal(be.to_host(d), h)
    sumexp = be.empty((B,), np.float64)
    be.ce_shard_sumexp(be.asarray(logits), be.asarray(host[0]), sumexp)
    c_sumexp = np.empty(B, np.float64)
    cpu.ce_shard_sumexp(logits, host[0], c_sumexp)
    np.testing.assert_allclose(be.to_host(sumexp), c_sumexp, rtol=1e-6)  # float32 sums against float64
    logz = np.log(c_sumexp) + host[0] + 0.25  # as if other blocks added to the row's sum
    dlogits, c_dlogits = be.empty((B, V)), np.empty((B, V), np.float32)
    be.ce_shard_grad(be.asarray(logits), be.asarray(targets), be.asarray(logz), dlogits, 0.5, **kw)
    cpu.ce_shard_grad(logits, targets, logz, c_dlogits, 0.5, **kw)
    np.testing.assert_allclose(be.to_host(dlogits), c_dlogits, **AGREE)


def test_cross_entropy_argmax_ties_take_the_first_index(be, cpu):
    logits = np.array([[1, 3, 3, 0], [2, 2, 2, 2], [0, 0, 5, 5]], np.float32)
    targets = np.array([2, 0, 2], np.int64)  # row 0: tie 1/2 -> 1 (wrong), row 1 -> 0 (right), row 2 -> 2 (right)
    _, correct = be.cross_entropy(be.asarray(logits), be.asarray(targets), be.empty((3, 4)), 1.0)
    _, c_correct = cpu.cross_entropy(logits, targets, np.empty((3, 4), np.float32), 1.0)
    assert correct == c_correct == 2


@pytest.mark.parametrize("bad", [-1, 9])
def test_cross_entropy_bad_target_raises_like_cpu(be, cpu, rng, bad):
    logits = rand(rng, 6, 9)
    targets = np.array([0, 1, 2, bad, 3, bad], np.int64)
    with pytest.raises(BackendError) as dev_error:
        be.cross_entropy(be.asarray(logits), be.asarray(targets), be.empty((6, 9)), 1.0)
    with pytest.raises(BackendError) as cpu_error:
        cpu.cross_entropy(logits, targets, np.empty((6, 9), np.float32), 1.0)
    assert str(dev_error.value) == str(cpu_error.value)
    assert f"target {bad} in row 3 is outside [0, 9)" in str(dev_error.value)


def test_cross_entropy_grad_scale_zero_for_evaluation(be, rng):
    logits, targets = rand(rng, 4, 5), np.array([0, 1, 2, 3], np.int64)
    dlogits = be.empty((4, 5))
    total, _ = be.cross_entropy(be.asarray(logits), be.asarray(targets), dlogits, 0.0)
    np.testing.assert_allclose(total, ref.cross_entropy(logits, targets)[0], rtol=1e-5)
    np.testing.assert_array_equal(be.to_host(dlogits), 0)


@pytest.mark.parametrize("B,C", SHAPES)
def test_mse(be, cpu, rng, B, C):
    pred, target = rand(rng, B, C), rand(rng, B, C)
    scale = 1.0 / (B * C)
    dpred = be.empty((B, C))
    total = be.mse(be.asarray(pred), be.asarray(target), dpred, scale)
    r_total, r_grad = ref.mse(pred, target)
    assert isinstance(total, float)
    np.testing.assert_allclose(total, r_total, rtol=1e-6)
    np.testing.assert_allclose(be.to_host(dpred), r_grad * scale, **F32)
    c_grad = np.empty((B, C), np.float32)
    np.testing.assert_allclose(total, cpu.mse(pred, target, c_grad, scale), rtol=1e-6)
    np.testing.assert_allclose(be.to_host(dpred), c_grad, **AGREE)


# ----------------------------------------------------------------- flat buffers


@pytest.mark.parametrize("n", [0, 1, 63, 1000])
def test_sum_squares_scale_fill(be, cpu, rng, n):
    x = rand(rng, n)
    d = be.asarray(x)
    total = be.sum_squares(d)
    assert isinstance(total, float)
    np.testing.assert_allclose(total, (x.astype(np.float64) ** 2).sum(), rtol=1e-6)
    np.testing.assert_allclose(total, cpu.sum_squares(x), rtol=1e-6)
    be.scale_(d, 0.37)
    want = x.copy()
    cpu.scale_(want, 0.37)
    np.testing.assert_array_equal(be.to_host(d), want)
    be.fill_(d, 2.5)
    np.testing.assert_array_equal(be.to_host(d), np.full(n, 2.5, np.float32))


def test_fill_any_shape_and_dtype(be):
    a = be.empty((3, 7))
    be.fill_(a, -1.5)
    np.testing.assert_array_equal(be.to_host(a), np.full((3, 7), -1.5, np.float32))
    t = be.empty((5,), np.int64)
    be.fill_(t, 7)
    np.testing.assert_array_equal(be.to_host(t), np.full(5, 7))
    np.testing.assert_array_equal(be.to_host(be.zeros((2, 3), np.float64)), np.zeros((2, 3)))


# ----------------------------------------------------------------- optimizers


@pytest.mark.parametrize("momentum,nesterov,weight_decay,clip", [(0.0, False, 0.0, 1.0), (0.0, False, 0.01, 0.5),
                                                                 (0.9, False, 0.0, 1.0), (0.9, True, 0.05, 0.3)])
def test_sgd_update(be, cpu, rng, momentum, nesterov, weight_decay, clip):
    """``clip``: the clipping factor the kernel applies as it reads the gradients (the reference scales first)."""
    n, lr = 77, 0.1
    p, buf = rand(rng, n), np.zeros(n, np.float32)
    dp, dbuf = be.asarray(p), be.asarray(buf)
    cp, cbuf = p.copy(), buf.copy()
    rp, rbuf = p.astype(np.float64), buf.astype(np.float64)
    for _ in range(3):
        g = rand(rng, n)
        kw = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, grad_scale=clip)
        be.sgd_update(dp, be.asarray(g), dbuf, **kw)
        cpu.sgd_update(cp, g, cbuf, **kw)
        rp, rbuf = ref.sgd(rp, g * np.float32(clip), rbuf, lr, momentum, weight_decay, nesterov)
    np.testing.assert_allclose(be.to_host(dp), rp, **F32)
    np.testing.assert_allclose(be.to_host(dp), cp, **AGREE)
    np.testing.assert_allclose(be.to_host(dbuf), cbuf, **AGREE)


@pytest.mark.parametrize("decoupled,weight_decay,clip", [(False, 0.0, 1.0), (False, 0.1, 0.5), (True, 0.01, 0.25)])
def test_adam_update(be, cpu, rng, decoupled, weight_decay, clip):
    n, hp = 77, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
    p = rand(rng, n)
    dp, dm, dv = be.asarray(p), be.zeros((n,)), be.zeros((n,))
    cp, cm, cv = p.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    rp, rm, rv = p.astype(np.float64), np.zeros(n), np.zeros(n)
    for step in range(1, 4):
        g = rand(rng, n)
        kw = dict(hp, weight_decay=weight_decay, step=step, decoupled=decoupled, grad_scale=clip)
        be.adam_update(dp, be.asarray(g), dm, dv, **kw)
        cpu.adam_update(cp, g, cm, cv, **kw)
        rp, rm, rv = ref.adam(rp, g * np.float32(clip), rm, rv, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], weight_decay, step,
                              decoupled)
    np.testing.assert_allclose(be.to_host(dp), rp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(be.to_host(dp), cp, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(be.to_host(dm), cm, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(be.to_host(dv), cv, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("which", ["cuda", "cpu"])
@pytest.mark.parametrize("rule", ["sgd", "sgd-momentum", "adam", "adamw"])
def test_one_update_over_runs_of_two_decays_is_the_updates_run_by_run(be, cpu, rng, rule, which):
    """``weight_decay = be.decay_table(runs)`` (optim.py: weight matrices decayed, biases not) gives the bits of
    one update per run with its own decay (on the CUDA backend in one launch, on the CPU run by run)."""
    be = be if which == "cuda" else cpu
    n, wd = 77, 0.05
    runs = [(0, 20, wd), (20, 23, 0.0), (23, 60, wd), (60, 61, 0.0), (61, 77, wd)]
    p = rand(rng, n)
    one = [be.asarray(p.copy()) for _ in range(2)]
    slots = [[be.zeros((n,)), be.zeros((n,))] for _ in range(2)]
    table = be.decay_table([(lo, hi, d) for lo, hi, d in runs])
    for step in range(1, 4):
        g = be.asarray(rand(rng, n))
        for k, (params, (m, v)) in enumerate(zip(one, slots)):
            pieces = [(0, n, table)] if k == 0 else runs
            for lo, hi, decay in pieces:
                if rule.startswith("sgd"):
                    be.sgd_update(params[lo:hi], g[lo:hi], m[lo:hi], lr=0.1, momentum=0.9 if "momentum" in rule
                                  else 0.0, weight_decay=decay, nesterov=False, grad_scale=0.5)
                else:
                    be.adam_update(params[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], lr=1e-2, beta1=0.9, beta2=0.999,
                                   eps=1e-8, weight_decay=decay, step=step, decoupled=rule == "adamw", grad_scale=0.5)
    per = [be.to_host(a) for a in (one[1], *slots[1])]
    for got, want in zip((be.to_host(a) for a in (one[0], *slots[0])), per):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(per[0], p)


def test_decay_runs_that_do_not_fit_are_refused(be):
    with pytest.raises(BackendError, match="one weight decay and 0"):
        be.decay_table([(0, 4, 0.1), (4, 8, 0.2)])
    with pytest.raises(BackendError, match="adam_update: weight_decay runs cover 8 values, the arrays 4"):
        be.adam_update(be.zeros((4,)), be.zeros((4,)), be.zeros((4,)), be.zeros((4,)), lr=1e-3, beta1=0.9,
                       beta2=0.999, eps=1e-8, weight_decay=be.decay_table([(0, 8, 0.1)]), step=1, decoupled=True)


# ----------------------------------------------------------------- the GPU launch shapes in the simulator


def test_gpu_default_block_shapes_run(rng):
    """256-thread blocks and 32×8 column-sum blocks, as on a GPU, on one small launch each."""
    be = CudaBackend(tile=GPU_TILE, block=256, max_blocks=2, gemm="numba")
    B, C = 3, 37
    x, dout, w, b = rand(rng, B, C), rand(rng, B, C), rand(rng, C), rand(rng, C)
    dbias = be.empty((C,))
    be.bias_grad(be.asarray(dout), dbias)
    np.testing.assert_allclose(be.to_host(dbias), dout.astype(np.float64).sum(0), **F32)
    out, mean, rstd = be.empty((B, C)), be.empty((B,)), be.empty((B,))
    be.layernorm_forward(be.asarray(x), be.asarray(w), be.asarray(b), 1e-5, out, mean, rstd)
    np.testing.assert_allclose(be.to_host(out), ref.layernorm(x, w, b, 1e-5)[0], **F32)
    targets = np.array([0, 5, 36], np.int64)
    total, _ = be.cross_entropy(be.asarray(x), be.asarray(targets), be.empty((B, C)), 1.0)
    np.testing.assert_allclose(total, ref.cross_entropy(x, targets)[0], rtol=1e-5)
    np.testing.assert_allclose(be.sum_squares(be.asarray(x.ravel())), (x.astype(np.float64) ** 2).sum(), rtol=1e-6)


@pytest.mark.parametrize("kw,match", [(dict(block=12), "power of two"), (dict(block=2048), "power of two"),
                                      (dict(max_blocks=0), "max_blocks must be >= 1")])
def test_bad_launch_shapes_are_rejected(kw, match):
    with pytest.raises(BackendError, match=match):
        CudaBackend(**kw)
