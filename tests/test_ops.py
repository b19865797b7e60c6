"""CPU kernels against the numpy references, and the references' gradients against finite differences."""

import numpy as np
import pytest

import reference as ref
from hpctrain.backend.cpu import CpuBackend
from hpctrain.errors import BackendError

be = CpuBackend()
rng = np.random.default_rng(0)
F32 = dict(rtol=1e-5, atol=1e-5)


def rand(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar f at float64 x."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        hi = f(x)
        x[i] = old - eps
        lo = f(x)
        x[i] = old
        g[i] = (hi - lo) / (2 * eps)
    return g


# ----------------------------------------------------------------- matmul / linear

@pytest.mark.parametrize("B,K,N", [(1, 1, 1), (5, 7, 9), (33, 17, 3)])
def test_linear_kernels(B, K, N):
    x, w, b, dout = rand(B, K), rand(N, K), rand(N), rand(B, N)
    y = be.empty((B, N))
    be.matmul_nt(x, w, y, bias=b)
    np.testing.assert_allclose(y, ref.linear_forward(x, w, b), **F32)
    dinp_ref, dw_ref, db_ref = ref.linear_backward(dout, x, w)
    dinp, dw, db = be.empty((B, K)), be.empty((N, K)), be.empty((N,))
    be.matmul_nn(dout, w, dinp)
    be.matmul_tn(dout, x, dw)
    be.bias_grad(dout, db)
    np.testing.assert_allclose(dinp, dinp_ref, **F32)
    np.testing.assert_allclose(dw, dw_ref, **F32)
    np.testing.assert_allclose(db, db_ref, **F32)
    be.matmul_tn(dout, x, dw, accumulate=True)
    be.bias_grad(dout, db, accumulate=True)
    np.testing.assert_allclose(dw, 2 * dw_ref, **F32)
    np.testing.assert_allclose(db, 2 * db_ref, **F32)


@pytest.mark.parametrize("K,M,N", [(0, 3, 4), (1, 1, 1), (64, 96, 80), (7, 130, 3)])
def test_weight_gradient_accumulates_inside_the_gemm_as_numpy_adds_it(K, M, N):
    """matmul_tn(accumulate=True) through numpy's BLAS with beta = 1 (backend/cpu/blas.py) and through the temporary
    and add it replaces: both equal the float64 sum, and an empty product leaves the gradient as it was."""
    a, b, start = rand(K, M), rand(K, N), rand(M, N)
    expected = start.astype(np.float64) + a.astype(np.float64).T @ b.astype(np.float64)
    fallback = CpuBackend()
    fallback._sgemm = None
    for backend in (be, fallback):
        out = start.copy()
        backend.matmul_tn(a, b, out, accumulate=True)
        np.testing.assert_allclose(out, expected, **F32)


def test_numpy_wheels_bundled_blas_is_found():
    """numpy's own Linux wheels link scipy-openblas64: there the beta = 1 product must be in use, not the slower
    fallback (which other builds take)."""
    import sys

    from hpctrain.backend.cpu.blas import Sgemm

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    except (TypeError, KeyError):  # numpy before 1.26 has no mode="dicts"
        pytest.skip("numpy does not describe its BLAS")
    if not (sys.platform.startswith("linux") and blas.get("name") == "scipy-openblas"
            and "USE64BITINT" in blas.get("openblas configuration", "")):
        pytest.skip(f"numpy built against {blas.get('name')!r} on {sys.platform}: the fallback is the expected path")
    found = Sgemm.find()
    assert found is not None and found.name == "scipy_cblas_sgemm64_"
    assert be._sgemm is not None


def test_linear_reference_gradient_matches_finite_differences():
    x, w, b = (rng.standard_normal(s) for s in [(3, 4), (5, 4), (5,)])
    c = rng.standard_normal((3, 5))  # loss = sum(c * y)
    dinp, dw, db = ref.linear_backward(c, x, w)
    np.testing.assert_allclose(dinp, numeric_grad(lambda x_: (c * ref.linear_forward(x_, w, b)).sum(), x), rtol=1e-6)
    np.testing.assert_allclose(dw, numeric_grad(lambda w_: (c * ref.linear_forward(x, w_, b)).sum(), w), rtol=1e-6)
    np.testing.assert_allclose(db, numeric_grad(lambda b_: (c * ref.linear_forward(x, w, b_)).sum(), b), rtol=1e-6)


# ----------------------------------------------------------------- activations

ACTS = {
    "relu": (ref.relu, ref.relu_backward, False),
    "gelu": (ref.gelu, ref.gelu_backward, False),
    "tanh": (np.tanh, ref.tanh_backward, True),  # backward takes the output
}


@pytest.mark.parametrize("name", ACTS)
def test_activation_kernels(name):
    fwd_ref, bwd_ref, uses_output = ACTS[name]
    x, dout = rand(7, 5, scale=2.0), rand(7, 5)
    y = be.empty(x.shape)
    getattr(be, f"{name}_forward")(x, y)
    np.testing.assert_allclose(y, fwd_ref(x), **F32)
    dinp = be.empty(x.shape)
    getattr(be, f"{name}_backward")(y if uses_output else x, dout, dinp)
    np.testing.assert_allclose(dinp, bwd_ref(fwd_ref(x) if uses_output else x, dout), **F32)


@pytest.mark.parametrize("name", ACTS)
def test_activation_reference_gradient_matches_finite_differences(name):
    fwd_ref, bwd_ref, uses_output = ACTS[name]
    x = rng.standard_normal((3, 4)) * 2 + 0.01  # keep away from relu's kink at 0
    c = rng.standard_normal((3, 4))
    analytic = bwd_ref(fwd_ref(x) if uses_output else x, c)
    np.testing.assert_allclose(analytic, numeric_grad(lambda x_: (c * fwd_ref(x_)).sum(), x), rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------- layernorm

@pytest.mark.parametrize("B,C", [(1, 3), (6, 10)])
def test_layernorm_kernels(B, C):
    x, w, b, dout = rand(B, C, scale=3.0), rand(C), rand(C), rand(B, C)
    out, mean, rstd = be.empty((B, C)), be.empty((B,)), be.empty((B,))
    be.layernorm_forward(x, w, b, 1e-5, out, mean, rstd)
    y_ref, mean_ref, rstd_ref = ref.layernorm(x, w, b, 1e-5)
    np.testing.assert_allclose(out, y_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, rstd_ref, rtol=1e-4)
    dinp, dw, db = be.empty((B, C)), be.empty((C,)), be.empty((C,))
    be.layernorm_backward(dout, x, w, mean, rstd, dinp, dw, db)
    for got, want in zip((dinp, dw, db), ref.layernorm_backward(dout, x, w, 1e-5)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_layernorm_reference_gradient_matches_finite_differences():
    x, w, b = rng.standard_normal((3, 5)), rng.standard_normal(5), rng.standard_normal(5)
    c = rng.standard_normal((3, 5))
    dinp, dw, db = ref.layernorm_backward(c, x, w, 1e-5)
    f = lambda x_, w_, b_: (c * ref.layernorm(x_, w_, b_, 1e-5)[0]).sum()  # noqa: E731
    np.testing.assert_allclose(dinp, numeric_grad(lambda v: f(v, w, b), x), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(dw, numeric_grad(lambda v: f(x, v, b), w), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(db, numeric_grad(lambda v: f(x, w, v), b), rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------- losses

def test_cross_entropy_kernel():
    logits, targets = rand(9, 4, scale=3.0), rng.integers(0, 4, 9).astype(np.int64)
    dlogits = be.empty(logits.shape)
    total, correct = be.cross_entropy(logits, targets, dlogits, 1 / 9)
    loss_ref, correct_ref, grad_ref = ref.cross_entropy(logits, targets)
    assert total == pytest.approx(loss_ref, rel=1e-6)
    assert correct == correct_ref
    np.testing.assert_allclose(dlogits, grad_ref / 9, **F32)


def test_cross_entropy_reference_gradient_matches_finite_differences():
    z, t = rng.standard_normal((4, 3)), np.array([0, 2, 1, 2])
    np.testing.assert_allclose(ref.cross_entropy(z, t)[2], numeric_grad(lambda z_: ref.cross_entropy(z_, t)[0], z),
                               rtol=1e-6, atol=1e-9)


def test_cross_entropy_rejects_out_of_range_target():
    with pytest.raises(BackendError, match="target 7 in row 1"):
        be.cross_entropy(rand(2, 3), np.array([0, 7], np.int64), be.empty((2, 3)), 1.0)


def test_mse_kernel_and_gradient():
    pred, target = rand(6, 3), rand(6, 3)
    dpred = be.empty(pred.shape)
    total = be.mse(pred, target, dpred, 1 / 18)
    loss_ref, grad_ref = ref.mse(pred, target)
    assert total == pytest.approx(loss_ref, rel=1e-6)
    np.testing.assert_allclose(dpred, grad_ref / 18, **F32)
    p64 = pred.astype(np.float64)
    np.testing.assert_allclose(grad_ref, numeric_grad(lambda p: ref.mse(p, target)[0], p64), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------- flat buffers

def test_sum_squares_and_scale():
    x = rand(1001)
    assert be.sum_squares(x) == pytest.approx(float((x.astype(np.float64) ** 2).sum()), rel=1e-9)
    y = x.copy()
    be.scale_(y, 0.5)
    np.testing.assert_allclose(y, x * 0.5, **F32)


def test_relu_passes_nan_through_like_torch():
    x = np.array([[np.nan, -1.0, 2.0]], dtype=np.float32)
    out = be.empty((1, 3))
    be.relu_forward(x, out)
    np.testing.assert_array_equal(out, ref.relu(x))  # [nan, 0, 2]: a NaN must not turn into a clean 0


# ----------------------------------------------------------------- bad input

def test_kernels_reject_wrong_dtype_layout_and_shape():
    x, w = rand(4, 3), rand(5, 3)
    with pytest.raises(BackendError, match="matmul_nt: a must be float32, got float64"):
        be.matmul_nt(x.astype(np.float64), w, be.empty((4, 5)))
    with pytest.raises(BackendError, match="matmul_nt: a must be C-contiguous"):
        be.matmul_nt(rand(3, 4).T, w, be.empty((4, 5)))
    with pytest.raises(BackendError, match=r"matmul_nt: b has shape \(5, 2\), expected 3 columns"):
        be.matmul_nt(x, rand(5, 2), be.empty((4, 5)))
    with pytest.raises(BackendError, match=r"relu_backward: dout has shape \(2, 2\), expected \(4, 3\)"):
        be.relu_backward(x, rand(2, 2), be.empty((4, 3)))
    with pytest.raises(BackendError, match="cross_entropy: targets must be int64"):
        be.cross_entropy(x, np.zeros(4, np.int32), be.empty((4, 3)), 1.0)
