"""The cuBLASLt provider on a real GPU: the cases tests/test_cublaslt.py proves against its emulator, run by the
real library (the same buffers, reference and checks: padding untouched, bias and aux where the epilogue writes
them), and the same bits from a repeated call.

Skipped with the reason where cuBLASLt cannot load (no nvmath-python, no libcublasLt: pip install
'hpctrain[cuda]'); bench/bench_cublaslt.py prints the same reason in bench/gpu_all.sh's table.
"""

import os
import sys

import numpy as np
import pytest
from cudatest import needs_gpu
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the CPU-side proof
from cublaslt_load import cublaslt  # noqa: E402
from test_cublaslt import Req, run_case  # noqa: E402

pytestmark = needs_gpu("cuBLASLt runs on a device; the simulator has none")


@pytest.fixture(scope="module")
def lib():
    reason = cublaslt.unavailable()
    if reason:
        pytest.skip(reason)
    with cublaslt.Cublaslt() as lib:
        yield lib


def on_device(lib, req, stream):
    """An ``emulate`` for run_case that copies the host buffers to the GPU, runs cuBLASLt and copies back."""
    def run(call, b, a, c, bias=None, aux=None):
        dev = {}
        for name, x in (("a", a), ("b", b), ("c", c), ("bias", bias), ("aux", aux)):
            if x is not None:
                dev[name] = cuda.to_device(x.view(np.uint16) if x.dtype.itemsize == 2 else x, stream=stream)
        lib.gemm(req, stream=stream, **dev)
        for name, x in (("c", c), ("bias", bias), ("aux", aux)):
            if x is not None and name in dev:
                host = dev[name].copy_to_host(stream=stream)
                stream.synchronize()
                x[...] = host.view(x.dtype)
    return run


CASES = [Req(op, 37, 45, 29, precision=p) for op in cublaslt.OPS for p in ("fp32", "tf32", "bf16")] + [
    Req("nt", 37, 45, 29, precision="bf16", out="fp32"),
    Req("tn", 33, 40, 300, accumulate=True, alpha=0.5),
    Req("nn", 19, 24, 31, lda=40, ldb=32, ldc=32),
    Req("nt", 16, 24, 32, batch=12, stride_a=16 * 32 + 8, stride_b=24 * 32, stride_c=16 * 24 + 8),
    Req("tn", 16, 24, 32, precision="bf16", batch=6, stride_a=32 * 16, stride_b=32 * 24, stride_c=16 * 24),
] + [Req(op, 64, 96, 48, precision=p, epilogue=e) for e, op in (("bias", "nt"), ("gelu_aux_bias", "nt"),
                                                                  ("dgelu", "nn"), ("bgradb", "tn"))
     for p in ("fp32", "bf16")]


@pytest.mark.parametrize("req", CASES, ids=lambda r: f"{r.op}-{r.precision}-{r.epilogue}-b{r.batch}")
def test_cublaslt_matches_the_row_major_reference(lib, req):
    run_case(req, seed=1, emulate=on_device(lib, req, cuda.stream()))


def test_cublaslt_repeats_bitwise(lib):
    """One algorithm per shape, no in-place split-K: a long-K weight gradient gives the same bits every call."""
    rng = np.random.default_rng(0)
    K, M, N = 8192, 256, 192
    da, db = (cuda.to_device(rng.standard_normal((K, n)).astype(np.float32)) for n in (M, N))
    dc = cuda.device_array((M, N), np.float32)
    req = Req("tn", M, N, K, precision="tf32")
    queries = lib.heuristic_queries
    results = []
    for _ in range(3):
        lib.gemm(req, a=da, b=db, c=dc)
        results.append(dc.copy_to_host())
    assert lib.heuristic_queries == queries + 1
    assert all(np.array_equal(results[0], r) for r in results[1:])


def test_the_backend_runs_its_linear_products_through_cublaslt(lib):
    """``CudaBackend(gemm="cublaslt")`` on the real library: each of the three products against numpy, a bias view
    of a flat buffer 4 bytes past an allocation (copied for the BIAS epilogue), a weight gradient accumulated
    (beta = 1), all on the backend's stream, none run by the numba kernels. The simulator's run of the same wiring
    with a stand-in provider: tests/cuda/test_cuda_gemm_provider.py."""
    from hpctrain.backend.cuda import CudaBackend

    be = CudaBackend(gemm="cublaslt")
    assert be.gemm_provider == "cublaslt"
    rng = np.random.default_rng(2)
    M, K, N = 37, 45, 29
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K), (M, N)))
    flat_b = rng.standard_normal(N + 1).astype(np.float32)
    tol = dict(rtol=1e-4, atol=1e-4)
    out = be.empty((M, N))
    be.matmul_nt(be.asarray(x), be.asarray(w), out, bias=be.asarray(flat_b)[1:])
    np.testing.assert_allclose(be.to_host(out), x.astype(np.float64) @ w.T + flat_b[1:], **tol)
    dx = be.empty((M, K))
    be.matmul_nn(be.asarray(dy), be.asarray(w), dx)
    np.testing.assert_allclose(be.to_host(dx), dy.astype(np.float64) @ w, **tol)
    dw = be.asarray(np.ones((N, K), np.float32))
    be.matmul_tn(be.asarray(dy), be.asarray(x), dw, accumulate=True)
    np.testing.assert_allclose(be.to_host(dw), dy.T.astype(np.float64) @ x + 1, **tol)
    assert be.gemm_fallbacks == {}


def test_bf16_linear_products_are_cublaslt_bf16_gemms(lib):
    """``train.precision = "bf16"`` with cuBLASLt: a Linear's kept input (bfloat16 words) and its float32 weight go
    to the real library as a bf16 GEMM with float32 output (tensor cores), and each product lands within one
    bfloat16 step of the CPU reference's, most elements equal; none runs in the numba kernels."""
    from hpctrain.backend.cpu.precision import Bf16CpuBackend
    from hpctrain.backend.cuda.precision import Bf16CudaBackend

    be, ref = Bf16CudaBackend(gemm="cublaslt"), Bf16CpuBackend()
    rng = np.random.default_rng(4)
    M, K, N = 64, 96, 48
    x, w, b, dy = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K), (N,), (M, N)))
    kept = be.product_input(be.asarray(x))
    got = {"out": be.empty((M, N)), "dx": be.empty((M, K)), "dw": be.empty((N, K))}
    be.matmul_nt(kept, be.asarray(w), got["out"], bias=be.asarray(b))
    be.matmul_nn(be.asarray(dy), be.asarray(w), got["dx"])
    be.matmul_tn(be.asarray(dy), kept, got["dw"])
    want = {"out": np.empty((M, N), np.float32), "dx": np.empty((M, K), np.float32),
            "dw": np.empty((N, K), np.float32)}
    ref.matmul_nt(x, w, want["out"], bias=b)
    ref.matmul_nn(dy, w, want["dx"])
    ref.matmul_tn(dy, x, want["dw"])
    for name in got:
        g, r = be.to_host(got[name]).astype(np.float64), want[name].astype(np.float64)
        assert np.all(np.abs(g - r) <= 2.0 ** -7 * np.abs(r) + 1e-30), name
        assert np.mean(g == r) >= 0.9, name
    assert be.gemm_fallbacks == {}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_math_attention_through_cublaslt_matches_the_numba_kernels(lib, precision):
    """Math attention's products as strided-batched cuBLASLt calls over contiguous heads (backend/cuda/attention.py)
    against the numba kernels' batched products, forward and backward, at a head size and length that align."""
    from hpctrain.backend.cuda import CudaBackend
    from hpctrain.backend.cuda.precision import Bf16CudaBackend

    make = Bf16CudaBackend if precision == "bf16" else CudaBackend
    rng = np.random.default_rng(5)
    B, T, H, hs = 2, 64, 4, 32
    C = H * hs
    qkv, dout = (rng.standard_normal(s).astype(np.float32) for s in ((B * T, 3 * C), (B * T, C)))
    results = []
    for gemm in ("cublaslt", "numba"):
        be = make(gemm=gemm)
        out, att, dqkv = be.empty((B * T, C)), be.empty((B, H, T, T)), be.empty((B * T, 3 * C))
        be.attention_forward(be.asarray(qkv), T, H, out, att)
        be.attention_backward(be.asarray(dout), be.asarray(qkv), att, T, H, dqkv)
        results.append([be.to_host(a) for a in (out, att, dqkv)])
        assert be.gemm_fallbacks == {}
    tol = dict(rtol=2 ** -6, atol=2 ** -6) if precision == "bf16" else dict(rtol=1e-4, atol=1e-5)
    for lt, numba in zip(*results):
        np.testing.assert_allclose(lt, numba, **tol)


def test_step_graphs_capture_the_cublaslt_calls(lib, tmp_path):
    """With cuda.graphs, a GPT step's cuBLASLt products (the Linears' and attention's strided ones) are captured
    into the segments' graphs (launch.py's build_graph: run on the builder's capturing stream): once the graphs
    replay, no launch is made from Python, and the parameters are the bits of the same run without graphs."""
    import dataclasses

    from helpers import gpt_config, make_tokens
    from hpctrain.config import CudaConfig
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    make_tokens(tmp_path / "t.h5", n=2000)
    cfg = gpt_config(tmp_path / "t.h5", model={"block_size": 32, "n_embd": 64, "n_head": 4},
                     data={"val_fraction": 0.0}, train={"steps": 4, "batch_size": 8, "backend": "cuda"},
                     optim={"name": "adamw", "lr": 0.01})
    mesh, runs = Mesh(), {}
    try:
        for graphs in (False, True):
            trainer = Trainer(dataclasses.replace(cfg, cuda=CudaConfig(gemm="cublaslt", graphs=graphs)), mesh=mesh,
                              log=lambda *a: None)
            seen = [trainer.train_step(step, 0.01) for step in range(4)]
            runs[graphs] = trainer.be.to_host(trainer.params.data), seen, trainer.be.gemm_fallbacks
            trainer.close()
    finally:
        mesh.free()
    (plain, _, _), (graphed, seen, fallbacks) = runs[False], runs[True]
    assert fallbacks == {}
    assert [s["python_launches"] for s in seen[2:]] == [0, 0] and seen[3]["graph_launches"] > 0, seen
    assert np.array_equal(graphed, plain)
