"""The CUDA simulator itself: shared arrays must be one array per block however its threads interleave.

numba-cuda's simulator creates a block's ``cuda.shared.array`` in whichever thread reaches
the line first, with an unlocked check-then-store; a thread switch inside that window gave
threads of the same block different arrays, so reductions and GEMM tiles read garbage now
and then (a training test failed once with "the gradients contain NaN or Inf").
hpctrain.backend.cuda.sim makes the store atomic. These tests widen the window (every
``np.empty`` sleeps, so the interpreter switches threads right there) to make the old race
happen on every launch.
"""

import time

import numpy as np
import pytest
from numba import cuda, float32, float64

import reference as ref
from cudatest import SIM, F32, rand
from hpctrain.backend.cuda import sim as cuda_sim

pytestmark = pytest.mark.skipif(not SIM, reason="tests the CUDA simulator's shared arrays (no simulator on a GPU)")

NT = 16


@cuda.jit
def _every_thread_sees_every_write(out):
    a = cuda.shared.array(NT, float32)
    b = cuda.shared.array(NT, float64)
    t = cuda.threadIdx.x
    a[t] = float32(t + 1)
    b[t] = float64(2 * (t + 1))
    cuda.syncthreads()
    s = float64(0.0)
    for i in range(NT):
        s += a[i] + b[i]
    out[cuda.blockIdx.x * NT + t] = s


@pytest.fixture
def switch_inside_shared_array_creation(monkeypatch):
    """np.empty (what the simulator builds a shared array with) sleeps: other threads run meanwhile."""
    real_empty = np.empty
    calls = []

    def slow_empty(*args, **kwargs):
        calls.append(args)
        time.sleep(0.002)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(np, "empty", slow_empty)
    return calls


def test_shared_array_is_one_array_per_block(switch_inside_shared_array_creation):
    cuda_sim.install()  # what the backend's kernel factories do
    out = cuda.device_array(2 * NT, np.float64)
    _every_thread_sees_every_write[2, NT](out)
    assert switch_inside_shared_array_creation, "the simulator no longer builds shared arrays with np.empty"
    np.testing.assert_array_equal(out.copy_to_host(), np.full(2 * NT, 3 * NT * (NT + 1) / 2))


def test_backend_reductions_and_gemm_with_interleaved_threads(be, rng, switch_inside_shared_array_creation):
    """The kernels of a training step that use shared memory: block sums, the loss, the GEMM tiles."""
    x = rand(rng, 50)
    assert be.sum_squares(be.asarray(x)) == pytest.approx((x.astype(np.float64) ** 2).sum(), rel=1e-6)
    a, w, bias = rand(rng, 9, 6), rand(rng, 5, 6), rand(rng, 5)
    out = be.empty((9, 5))
    be.matmul_nt(be.asarray(a), be.asarray(w), out, bias=be.asarray(bias))
    np.testing.assert_allclose(be.to_host(out), a.astype(np.float64) @ w.T + bias, **F32)
    logits, targets = rand(rng, 6, 3), np.array([0, 2, 1, 1, 0, 2], np.int64)
    total, _ = be.cross_entropy(be.asarray(logits), be.asarray(targets), be.empty((6, 3)), 1.0)
    assert total == pytest.approx(ref.cross_entropy(logits, targets)[0], rel=1e-5)
    assert switch_inside_shared_array_creation
