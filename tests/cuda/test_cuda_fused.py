"""The fused kernels (issue 49 item 4) against the CPU backend, each op's launches counted, bits run to run.

LayerNorm's backward with its weight and bias gradients, a Linear's bias gradient and softmax cross-entropy with
its gradient and totals are one launch each; the residual add before a LayerNorm is fused into its forward, and
the residual's gradient into its backward. A reduction's last block adds the other blocks' partials
(backend/cuda/blocks.py: ``last_to_finish``): shapes here give several blocks, so that path runs, and two runs
must give the same bits. bench/count_launches.py counts a whole GPT micro-batch (docs/gpu.md).
"""

import collections
import sys
from pathlib import Path

import numpy as np
import pytest

from cudatest import AGREE, F32, rand
from hpctrain.backend.base import Backend

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from count_launches import count, kernel_name  # noqa: E402


@pytest.fixture
def launches(be, monkeypatch):
    """Kernel name -> launches made through ``be`` during the test."""
    seen = collections.Counter()
    original = be._launch

    def counted(kernel, grid, threads, *args):
        seen[kernel_name(kernel)] += 1
        original(kernel, grid, threads, *args)

    monkeypatch.setattr(be, "_launch", counted)
    return seen


def _counters_clear(be):
    """Every last-block counter is back to 0 after the launches (the next launch counts from 0)."""
    return all(not be.to_host(c).any() for c in be._counters)


# ----------------------------------------------------------------- LayerNorm backward: one launch


@pytest.mark.parametrize("B,C", [(0, 5), (1, 1), (3, 37), (11, 21)])  # 11 rows: more rows than the 4 blocks
@pytest.mark.parametrize("accumulate", [False, True])
def test_layernorm_backward_is_one_launch_and_agrees_with_the_cpu(be, cpu, rng, launches, B, C, accumulate):
    x, w, dout = rand(rng, B, C, scale=3) + 1, rand(rng, C), rand(rng, B, C)
    mean, rstd = np.empty(B, np.float32), np.empty(B, np.float32)
    cpu.layernorm_forward(x, w, rand(rng, C), 1e-5, np.empty((B, C), np.float32), mean, rstd)
    start_w, start_b = rand(rng, C), rand(rng, C)
    runs = []
    for _ in range(2):
        dinp, dw, db = be.empty((B, C)), be.asarray(start_w.copy()), be.asarray(start_b.copy())
        launches.clear()
        be.layernorm_backward(be.asarray(dout), be.asarray(x), be.asarray(w), be.asarray(mean), be.asarray(rstd),
                              dinp, dw, db, accumulate=accumulate)
        assert dict(launches) == {"layernorm_backward": 1}  # was 4: rows, partial sums, two column finishes
        runs.append([be.to_host(a) for a in (dinp, dw, db)])
    c_dinp, c_dw, c_db = np.empty((B, C), np.float32), start_w.copy(), start_b.copy()
    cpu.layernorm_backward(dout, x, w, mean, rstd, c_dinp, c_dw, c_db, accumulate=accumulate)
    np.testing.assert_allclose(runs[0][0], c_dinp, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(runs[0][1], c_dw, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(runs[0][2], c_db, rtol=1e-5, atol=2e-6)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*runs))
    assert _counters_clear(be)


# ----------------------------------------------------------------- a Linear's bias gradient: one launch


@pytest.mark.parametrize("B,C", [(0, 3), (1000, 5), (300, 37)])  # several row groups; several column blocks
@pytest.mark.parametrize("accumulate", [False, True])
def test_bias_grad_is_one_launch_and_deterministic(be, cpu, rng, launches, B, C, accumulate):
    dout, start = rand(rng, B, C) + np.float32(3.0), rand(rng, C)
    runs = []
    for _ in range(2):
        dbias = be.asarray(start.copy())
        launches.clear()
        be.bias_grad(be.asarray(dout), dbias, accumulate=accumulate)
        assert dict(launches) == {"bias_grad": 1}  # was 2: bias_grad_partials, column_finish
        runs.append(be.to_host(dbias))
    want = start.copy()
    cpu.bias_grad(dout, want, accumulate=accumulate)
    np.testing.assert_allclose(runs[0], want, **AGREE)
    assert runs[0].tobytes() == runs[1].tobytes()
    assert _counters_clear(be)


def test_bias_grad_uses_several_row_groups_and_column_blocks(be):
    """The shapes above reach the last-block path with G > 1 row groups and with several column blocks."""
    k = be._k
    assert -(-5 // k.RX) < be.wave and -(-1000 // (k.RY * 16)) > 1  # (1000, 5): G > 1
    assert -(-37 // k.RX) > 1  # (300, 37): several column blocks, each with its own counter


# ----------------------------------------------------------------- softmax cross-entropy: one launch


@pytest.mark.parametrize("B,C", [(1, 1), (9, 37), (6, 5)])  # 9 rows: more rows than blocks
def test_cross_entropy_is_one_launch_and_agrees_with_the_cpu(be, cpu, rng, launches, B, C):
    logits = rand(rng, B, C, scale=3)
    targets = rng.integers(0, C, B).astype(np.int64)
    targets[0] = logits[0].argmax()
    if C >= 5:
        logits[-1, 1] = logits[-1, 4] = logits[-1].max() + 1  # a tie: the first column wins
    runs = []
    for _ in range(2):
        dlogits, into = be.empty((B, C)), be.zeros((3,), np.float64)
        launches.clear()
        be.cross_entropy(be.asarray(logits), be.asarray(targets), dlogits, 0.5, into=into)
        assert dict(launches) == {"softmax_cross_entropy": 1}  # was 2: rows, then one block's finish
        runs.append((be.to_host(dlogits), be.to_host(into)))
    c_grad = np.empty((B, C), np.float32)
    c_total, c_correct = cpu.cross_entropy(logits, targets, c_grad, 0.5)
    (dlogits, (total, correct, bad)) = runs[0]
    np.testing.assert_allclose(total, c_total, rtol=1e-6)
    assert (correct, bad) == (c_correct, B)
    np.testing.assert_allclose(dlogits, c_grad, **AGREE)
    assert runs[0][0].tobytes() == runs[1][0].tobytes() and runs[0][1].tobytes() == runs[1][1].tobytes()
    assert _counters_clear(be)


def test_cross_entropy_online_softmax_takes_infinities_and_nans_as_the_cpu(be, cpu):
    """The online sum's rescaling: −inf logits add nothing (even first in a thread's columns), a NaN shows."""
    logits = np.array([[-np.inf, 1.0, -np.inf, 2.0] + [0.5] * 30, [np.nan] + [0.0] * 33], np.float32)
    targets = np.array([3, 1], np.int64)
    dlogits, into = be.empty(logits.shape), be.zeros((3,), np.float64)
    be.cross_entropy(be.asarray(logits[:1]), be.asarray(targets[:1]), be.empty((1, 34)), 1.0, into=into[:3])
    c_total, _ = cpu.cross_entropy(logits[:1], targets[:1], np.empty((1, 34), np.float32), 1.0)
    assert be.to_host(into)[0] == pytest.approx(c_total, rel=1e-6)
    be.cross_entropy(be.asarray(logits), be.asarray(targets), dlogits, 1.0, into=into)
    assert np.isnan(be.to_host(into)[0])


# ----------------------------------------------------------------- residual add + LayerNorm, forward and backward


@pytest.mark.parametrize("B,C", [(1, 1), (3, 37), (11, 21)])
def test_residual_layernorm_is_one_launch_each_way_and_agrees_with_the_cpu_and_the_unfused(
        be, cpu, rng, launches, B, C):
    x, res, w, b = rand(rng, B, C, scale=2), rand(rng, B, C), rand(rng, C), rand(rng, C)
    dout, dres, start_w, start_b = rand(rng, B, C), rand(rng, B, C), rand(rng, C), rand(rng, C)

    def run(backend, fused):
        """(x after the add, out, mean, rstd, dinp, dweight, dbias) on ``backend``, fused or as base.Backend's
        unfused sequence (add_, then the LayerNorm; the LayerNorm's backward, then add_)."""
        dev = backend.asarray
        xs = dev(x.copy())
        out, mean, rstd = backend.empty((B, C)), backend.empty((B,)), backend.empty((B,))
        forward = (type(backend).residual_layernorm_forward if fused else Backend.residual_layernorm_forward)
        launches.clear()
        forward(backend, xs, dev(res), dev(w), dev(b), 1e-5, out, mean, rstd)
        n_forward = sum(launches.values())
        dinp, dw, db = backend.empty((B, C)), dev(start_w.copy()), dev(start_b.copy())
        backward = (type(backend).residual_layernorm_backward if fused else Backend.residual_layernorm_backward)
        launches.clear()
        backward(backend, dev(dout), dev(dres), xs, dev(w), mean, rstd, dinp, dw, db, accumulate=True)
        n_backward = sum(launches.values())
        return [backend.to_host(a) for a in (xs, out, mean, rstd, dinp, dw, db)], (n_forward, n_backward)

    fused, n_fused = run(be, True)
    unfused, n_unfused = run(be, False)
    assert n_fused == (1, 1) and n_unfused == (2, 2)
    for a, b_ in zip(fused, unfused):
        np.testing.assert_array_equal(a, b_)  # the same float32 operations in the same order: the same bits
    want, _ = run(cpu, True)  # the CPU backend runs base.Backend's unfused sequence
    for got, w_, tol in zip(fused, want, (AGREE, AGREE, AGREE, dict(rtol=1e-5), dict(rtol=1e-4, atol=1e-5),
                                          dict(rtol=1e-5, atol=2e-6), dict(rtol=1e-5, atol=2e-6))):
        np.testing.assert_allclose(got, w_, **tol)
    np.testing.assert_allclose(fused[0], x + res, **F32)


# ----------------------------------------------------------------- a GPT micro-batch's launches


def test_a_gpt_micro_batch_launches_what_the_fusions_leave():
    """bench/count_launches.py on two layers: per block, one LayerNorm backward each, a bias gradient per
    Linear, three of the four residual adds in the LayerNorms; one launch for the loss (docs/gpu.md's figures)."""
    n = count(n_layer=2, batch=2, block_size=4, bias=True)
    assert n["layernorm_backward"] == n["layernorm_forward"] == 2 * 2 + 1
    assert n["bias_grad"] == 4 * 2 and n["softmax_cross_entropy"] == 1
    assert n["add"] == 2  # was 4 a block: the second residual's, forward (the others are in the LayerNorms)
    assert not {"layernorm_backward_rows", "layernorm_params_partials", "column_finish", "bias_grad_partials",
                "cross_entropy_rows", "cross_entropy_finish"} & set(n)
    assert sum(n.values()) == 72  # 102 before the fusions


def test_fused_reductions_at_the_gpu_block_shapes(cpu, rng):
    """256-thread blocks and 32×8 column-sum blocks, as on a GPU: several blocks finish through the last one."""
    from hpctrain.backend.cuda import CudaBackend

    gpu = CudaBackend(block=256, max_blocks=3)
    B, C = 300, 70  # bias_grad: 3 column blocks × 3 row groups
    assert gpu._k.RX == 32 and -(-C // 32) == 3
    dout = rand(rng, B, C)
    dbias, want = gpu.empty((C,)), np.empty(C, np.float32)
    gpu.bias_grad(gpu.asarray(dout), dbias)
    cpu.bias_grad(dout, want)
    np.testing.assert_allclose(gpu.to_host(dbias), want, **AGREE)
    B = 7  # LayerNorm: 3 blocks of rows
    dout, x, w = dout[:B].copy(), rand(rng, B, C, scale=2) + 1, rand(rng, C)
    mean, rstd = np.empty(B, np.float32), np.empty(B, np.float32)
    cpu.layernorm_forward(x, w, w, 1e-5, np.empty((B, C), np.float32), mean, rstd)
    dinp, dw, db = gpu.empty((B, C)), gpu.empty((C,)), gpu.empty((C,))
    gpu.layernorm_backward(gpu.asarray(dout), gpu.asarray(x), gpu.asarray(w), gpu.asarray(mean), gpu.asarray(rstd),
                           dinp, dw, db)
    c_dinp, c_dw, c_db = np.empty((B, C), np.float32), np.empty(C, np.float32), np.empty(C, np.float32)
    cpu.layernorm_backward(dout, x, w, mean, rstd, c_dinp, c_dw, c_db)
    np.testing.assert_allclose(gpu.to_host(dinp), c_dinp, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gpu.to_host(dw), c_dw, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(gpu.to_host(db), c_db, rtol=1e-5, atol=2e-6)
    assert _counters_clear(gpu)
