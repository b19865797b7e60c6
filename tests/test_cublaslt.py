"""The cuBLASLt GEMM provider (hpctrain/backend/cuda/gemm/cublaslt.py) without a GPU.

1. Every planned call, run through a numpy emulator of cuBLASLt's column-major semantics
   (tests/cublaslt_fake.py), equals the row-major numpy reference: each op, epilogue, precision, batch,
   padded leading dimensions and odd shapes; operand buffers are exactly as long as the plan may read.
2. ``Cublaslt`` against a fake of ``nvmath.bindings.cublasLt``: the calls and attributes it makes, one
   heuristic query per shape, the same algorithm, workspace and stream on every call, errors in one line.
3. Where nvmath-python is installed: the real bindings have every name, enum value and attribute dtype the
   provider and the fake use.
"""

import sys

import numpy as np
import pytest
from cublaslt_fake import (STORAGE, USED_FUNCTIONS, ComputeType, CudaDataType, FakeCublasLt, gelu_tanh,
                           gelu_tanh_grad, round_tf32)
from cublaslt_load import cublaslt

from hpctrain.errors import BackendError

Req = cublaslt.GemmRequest
SHAPES = [(1, 1, 1), (13, 7, 19), (5, 33, 3), (32, 16, 8)]


def stored_shapes(req):
    a = (req.M, req.K) if req.op[0] == "n" else (req.K, req.M)
    b = (req.N, req.K) if req.op[1] == "t" else (req.K, req.N)
    return a, b, (req.M, req.N)


def row_major_args(req):
    """Row strides and batch strides of A, B, C and aux as the request states them (never from the plan)."""
    sa, sb, sc = stored_shapes(req)
    lds = [sa[1] if req.lda is None else req.lda, sb[1] if req.ldb is None else req.ldb,
           req.N if req.ldc is None else req.ldc]
    strides = [req.stride_a, req.stride_b, req.stride_c] if req.batch > 1 else [0, 0, 0]
    return lds, strides, req.N if req.aux_ld is None else req.aux_ld


def make_buffer(rng, shape, ld, batch, stride, dtype):
    """A flat buffer exactly long enough for ``batch`` row-major [rows, cols] matrices at row stride ``ld``,
    ``stride`` apart; padding holds random values too (a plan that reads it gives a wrong answer)."""
    rows, cols = shape
    size = (batch - 1) * stride + (rows - 1) * ld + cols
    return (rng.standard_normal(size) * 0.5).astype(STORAGE[dtype])


def row_major(flat, shape, ld, z=0, stride=0):
    isz = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[z * stride:], shape=shape, strides=(ld * isz, isz))


def reference(req, a, b, c0, bias=None, aux=None):
    """The row-major result of ``req`` in float64: (C per batch, bias out, aux out)."""
    (lda, ldb, ldc), (za, zb, zc), aux_ld = row_major_args(req)
    (sa, sb, sc) = stored_shapes(req)
    out, bias_out, aux_out = [], None, None
    for z in range(req.batch):
        A = row_major(a, sa, lda, z, za).astype(np.float64)
        B = row_major(b, sb, ldb, z, zb).astype(np.float64)
        if req.precision == "tf32":
            A, B = round_tf32(A), round_tf32(B)
        opA = A if req.op[0] == "n" else A.T
        opB = B if req.op[1] == "n" else B.T
        C = req.alpha * (opA @ opB)
        if req.accumulate:
            C += row_major(c0, sc, ldc, z, zc).astype(np.float64)
        if req.epilogue in ("bias", "gelu_aux_bias"):
            C += bias.astype(np.float64)[None, :]
        if req.epilogue == "gelu_aux_bias":
            aux_out = C.copy()
            C = gelu_tanh(C)
        if req.epilogue == "dgelu":
            C *= gelu_tanh_grad(row_major(aux, sc, aux_ld).astype(np.float64))
        if req.epilogue == "bgradb":
            bias_out = opA.sum(axis=1)  # Σ_k A[k, m]
        out.append(C)
    return out, bias_out, aux_out


def tolerance(req):
    out = req.out or cublaslt.PRECISIONS[req.precision][0]
    return dict(rtol=1e-2, atol=1e-2) if out == "bf16" else dict(rtol=1e-5, atol=1e-5)


def run_case(req, seed=0, emulate=None):
    """Random buffers for ``req``, the planned call run on them (emulated, or by ``emulate(call, ...)``),
    and the result checked against the row-major reference, padding of C and aux untouched."""
    from cublaslt_fake import emulate as emu

    emulate = emulate or emu
    rng = np.random.default_rng(seed)
    call = cublaslt.plan(req)
    sa, sb, sc = stored_shapes(req)
    (lda, ldb, ldc), (za, zb, zc), aux_ld = row_major_args(req)
    dt, out = cublaslt.PRECISIONS[req.precision][0], req.out or cublaslt.PRECISIONS[req.precision][0]
    a = make_buffer(rng, sa, lda, req.batch, za, dt)
    b = make_buffer(rng, sb, ldb, req.batch, zb, dt)
    c = make_buffer(rng, sc, ldc, req.batch, zc, out)
    c0 = c.copy()
    bias = aux = None
    if req.epilogue in ("bias", "gelu_aux_bias", "bgradb"):
        bias = rng.standard_normal(req.M if req.epilogue == "bgradb" else req.N).astype(STORAGE[out])
    if req.epilogue in ("gelu_aux_bias", "dgelu"):
        aux = make_buffer(rng, sc, aux_ld, 1, 0, out)
    bias0, aux0 = (None if x is None else x.copy() for x in (bias, aux))
    want, want_bias, want_aux = reference(req, a, b, c0, bias0, aux0)
    emulate(call, b, a, c, bias=bias, aux=aux)  # cuBLASLt's first operand is the row-major B
    tol = tolerance(req)
    for z in range(req.batch):
        np.testing.assert_allclose(row_major(c, sc, ldc, z, zc).astype(np.float64), want[z], **tol)
    written = np.zeros(c.size, bool)
    for z in range(req.batch):
        row_major(written, sc, ldc, z, zc)[...] = True
    np.testing.assert_array_equal(c[~written], c0[~written])  # the padding between rows is not written
    if req.epilogue == "bgradb":
        np.testing.assert_allclose(bias.astype(np.float64), want_bias, **tol)
    if req.epilogue == "gelu_aux_bias":
        np.testing.assert_allclose(row_major(aux, sc, aux_ld).astype(np.float64), want_aux, **tol)
    return c


# --------------------------------------------------------------------------- 1. plan + emulator


@pytest.mark.parametrize("op", cublaslt.OPS)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("precision,out", [("fp32", None), ("tf32", None), ("bf16", None), ("bf16", "fp32")])
def test_plan_matches_row_major_product(op, M, N, K, precision, out):
    run_case(Req(op, M, N, K, precision=precision, out=out), seed=M * 7 + N)


@pytest.mark.parametrize("op", cublaslt.OPS)
def test_plan_with_padded_rows_accumulate_and_alpha(op):
    """Row strides wider than the rows (a head's columns read in place), C += alpha·op(A)·op(B)."""
    M, N, K = 11, 9, 14
    a_cols = K if op[0] == "n" else M
    b_cols = K if op[1] == "t" else N
    run_case(Req(op, M, N, K, lda=a_cols + 5, ldb=b_cols + 3, ldc=N + 7, accumulate=True, alpha=0.25))


@pytest.mark.parametrize("op", cublaslt.OPS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plan_strided_batch(op, precision):
    """Attention's products: batch 6 at strides with gaps, each product independent."""
    M, N, K = 7, 5, 9
    sa, sb, sc = (r * c + 3 for r, c in stored_shapes(Req(op, M, N, K)))
    run_case(Req(op, M, N, K, precision=precision, batch=6, stride_a=sa, stride_b=sb, stride_c=sc), seed=3)


def test_plan_batch_with_zero_stride_broadcasts():
    """stride 0: every product reads the same B (one weight against a batch of inputs)."""
    c = run_case(Req("nt", 4, 3, 5, batch=3, stride_a=20, stride_b=0, stride_c=12), seed=5)
    assert c.size == 36


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (13, 19, 7), (9, 8, 33)])
@pytest.mark.parametrize("epilogue,op", [("bias", "nt"), ("gelu_aux_bias", "nt"), ("dgelu", "nn"), ("bgradb", "tn")])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_plan_epilogues(M, N, K, epilogue, op, precision):
    aux_ld = -(-N // 8) * 8 + 8 if epilogue in ("gelu_aux_bias", "dgelu") else None
    run_case(Req(op, M, N, K, precision=precision, epilogue=epilogue, aux_ld=aux_ld), seed=M + N + K)


def test_bgradb_accumulates_the_product_and_writes_the_bias():
    run_case(Req("tn", 6, 10, 17, epilogue="bgradb", accumulate=True), seed=9)


def test_plan_is_the_documented_mapping():
    """Linear forward X[M,K]·W[N,K]ᵀ: cuBLASLt gets W first, transposed, m = N, n = M; aux ld rides along."""
    call = cublaslt.plan(Req("nt", 64, 384, 128, epilogue="gelu_aux_bias"))
    assert (call.transa, call.transb, call.m, call.n, call.k) == ("T", "N", 384, 64, 128)
    assert (call.a.rows, call.a.cols, call.a.ld) == (128, 384, 128)  # W [384,128] row-major
    assert (call.b.rows, call.b.cols, call.b.ld) == (128, 64, 128)  # X [64,128] row-major
    assert (call.c.rows, call.c.cols, call.c.ld) == (384, 64, 384)
    assert (call.epilogue, call.bias_len, call.aux_ld, call.beta) == ("GELU_AUX_BIAS", 384, 384, 0.0)
    wgrad = cublaslt.plan(Req("tn", 384, 128, 64, epilogue="bgradb", accumulate=True))
    assert (wgrad.transa, wgrad.transb, wgrad.bias_len, wgrad.beta) == ("N", "T", 384, 1.0)  # apex's wgrad
    assert cublaslt.plan(Req("nn", 3, 4, 5, precision="tf32")).compute == "COMPUTE_32F_FAST_TF32"


@pytest.mark.parametrize("kwargs,message", [
    (dict(op="tt"), "op must be one of"),
    (dict(M=0), "M must be an integer >= 1"),
    (dict(K=2.5), "K must be an integer"),
    (dict(precision="fp16"), "precision must be one of"),
    (dict(out="bf16"), "out 'bf16' with fp32 inputs"),
    (dict(epilogue="relu"), "epilogue must be one of"),
    (dict(epilogue="dgelu"), "epilogue 'dgelu' rides on op 'nn'"),
    (dict(epilogue="bias", batch=2), "needs batch 1"),
    (dict(epilogue="bias", accumulate=True), "cannot accumulate"),
    (dict(epilogue="gelu_aux_bias", aux_ld=12), "aux_ld must be a multiple of 8"),
    (dict(epilogue="gelu_aux_bias", aux_ld=8), "aux_ld must be an integer >= 10"),
    (dict(lda=3), "lda must be an integer >= 4"),
    (dict(batch=2, stride_a=-1), "stride_a must be an integer >= 0"),
])
def test_plan_rejects_bad_requests_in_one_line(kwargs, message):
    fields = dict(op="nt", M=5, N=10, K=4)
    fields.update(kwargs)
    with pytest.raises(BackendError, match=message) as e:
        cublaslt.plan(Req(**fields))
    assert "\n" not in str(e.value)


def test_emulator_refuses_a_plan_that_reads_past_the_buffer():
    """The emulator is what makes the plan tests bite: an ld one too small for the buffer raises."""
    from cublaslt_fake import emulate

    call = cublaslt.plan(Req("nn", 4, 3, 5))
    bad = call.__class__(**{**call.__dict__, "b": cublaslt.Layout("fp32", 5, 4, 6)})
    a, b, c = (np.zeros(n, np.float32) for n in (15, 20, 12))
    with pytest.raises(IndexError, match="reads element"):
        emulate(bad, a, b, c)


def test_tf32_rounding_is_emulated():
    x = np.array([1 + 2 ** -11, 1 + 2 ** -10, 1 + 3 * 2 ** -12], np.float32)
    np.testing.assert_array_equal(round_tf32(x), [1.0, 1 + 2 ** -10, 1 + 2 ** -10])


# --------------------------------------------------------------------------- 2. Cublaslt against the fake


class HostArray:
    """Host memory posing as a device array (what ``device_pointer`` reads)."""

    def __init__(self, arr):
        self.arr = arr
        self.__cuda_array_interface__ = {"data": (arr.ctypes.data, False), "shape": arr.shape,
                                         "typestr": arr.dtype.str, "version": 3}


class FakeStream:
    class handle:  # numba's Stream.handle is a ctypes c_void_p
        value = 0xABC0


@pytest.fixture
def fake(monkeypatch):
    lt = FakeCublasLt()
    allocs = []

    def alloc(nbytes):
        ws = HostArray(np.zeros(nbytes, np.uint8))
        allocs.append(ws)
        return ws

    monkeypatch.setattr(cublaslt, "_load", lambda: cublaslt._Bindings(lt, ComputeType, CudaDataType))
    monkeypatch.setattr(cublaslt, "_alloc_workspace", alloc)
    lt.allocs = allocs
    return lt


def bind(lt, *arrays):
    """Register host arrays as device memory; returns their addresses."""
    ptrs = []
    for x in arrays:
        lt.memory[x.ctypes.data] = x
        ptrs.append(x.ctypes.data)
    return ptrs


def provider_emulate(lt, lib, req, stream):
    """An ``emulate`` for run_case that goes through Cublaslt.gemm and the fake bindings instead."""
    def run(call, b, a, c, bias=None, aux=None):
        pa, pb, pc = bind(lt, a, b, c)
        pbias = bind(lt, bias)[0] if bias is not None else None
        paux = bind(lt, aux)[0] if aux is not None else None
        lib.gemm(req, a=pa, b=pb, c=pc, bias=pbias, aux=paux, stream=stream)
    return run


def at_address(n, offset):
    """n float32 zeros at an address that is ``offset`` past a multiple of 256."""
    raw = np.zeros(4 * n + 512, np.uint8)
    start = (offset - raw.ctypes.data) % 256
    return raw[start:start + 4 * n].view(np.float32)


def matmuls(lt):
    return [args[0] for name, args in lt.calls if name == "matmul"]


@pytest.mark.parametrize("req", [
    Req("nt", 13, 24, 7), Req("nn", 5, 8, 33, precision="tf32"), Req("tn", 9, 16, 17, accumulate=True, alpha=0.5),
    Req("nt", 7, 5, 9, precision="bf16", batch=4, stride_a=70, stride_b=50, stride_c=40),
    Req("nt", 13, 24, 7, epilogue="bias"), Req("nt", 13, 24, 7, epilogue="gelu_aux_bias"),
    Req("nn", 9, 16, 5, epilogue="dgelu"), Req("tn", 16, 12, 21, epilogue="bgradb", precision="bf16", out="fp32"),
], ids=lambda r: f"{r.op}-{r.precision}-{r.epilogue}-b{r.batch}")
def test_provider_runs_each_request_through_the_bindings(fake, req):
    with cublaslt.Cublaslt() as lib:
        run_case(req, emulate=provider_emulate(fake, lib, req, FakeStream()))
        (mm,) = matmuls(fake)
        assert mm["stream"] == 0xABC0 and mm["workspace_size"] == cublaslt.WORKSPACE_BYTES
        assert mm["workspace"] == fake.allocs[0].arr.ctypes.data
    assert not fake.objects  # close() destroyed the handle and every descriptor


def test_one_heuristic_query_per_shape_and_the_same_algorithm_every_call(fake):
    rng = np.random.default_rng(0)
    lib = cublaslt.Cublaslt(workspace_bytes=1 << 20)
    a, b, c = (rng.standard_normal(n).astype(np.float32) for n in (12 * 256, 8 * 256, 12 * 8 + 64))
    pa, pb, pc = bind(fake, a, b, c)
    req = Req("nt", 12, 8, 256)
    for stream in (0, 7, FakeStream()):
        lib.gemm(req, a=pa, b=pb, c=pc, stream=stream)
    assert lib.heuristic_queries == 1 and len(fake.live("desc")) == 1 and len(fake.live("layout")) == 3
    runs = matmuls(fake)
    assert len({r["algo"] for r in runs}) == 1 and len({r["desc"] for r in runs}) == 1
    assert [r["stream"] for r in runs] == [0, 7, 0xABC0]
    assert {r["workspace"] for r in runs} == {fake.allocs[0].arr.ctypes.data} and len(fake.allocs) == 1
    np.testing.assert_allclose(c[:96].reshape(12, 8), a.reshape(12, 256) @ b.reshape(8, 256).T, rtol=1e-5, atol=1e-4)
    c16, c48, c4 = (at_address(c.size, offset) for offset in (16, 48, 4))  # C aligned to 16, 16 and 4 bytes
    p16, p48, p4 = bind(fake, c16, c48, c4)
    lib.gemm(Req("nt", 12, 8, 128), a=pa, b=pb, c=p16)  # another shape: its own query and descriptors
    lib.gemm(Req("nt", 12, 8, 128), a=pa, b=pb, c=p48)  # another address, the same alignment: no new query
    assert lib.heuristic_queries == 2
    lib.gemm(Req("nt", 12, 8, 128), a=pa, b=pb, c=p4)  # C 4-byte aligned only: the alignment is part of the key
    assert lib.heuristic_queries == 3 and len(fake.live("desc")) == 3
    aligns = sorted(fake.objects[p]["MIN_ALIGNMENT_C_BYTES"] for p in fake.live("pref"))
    assert aligns[:2] == [4, 16] and all(fake.objects[p]["MIN_ALIGNMENT_D_BYTES"] ==
                                         fake.objects[p]["MIN_ALIGNMENT_C_BYTES"] for p in fake.live("pref"))
    lib.close()
    lib.close()  # idempotent
    assert not fake.objects


def test_descriptor_and_preference_attributes(fake):
    lib = cublaslt.Cublaslt(workspace_bytes=4096)
    rng = np.random.default_rng(1)
    x, w, y, bias = (at_address(n, off) for n, off in ((6 * 5, 4), (16 * 5, 0), (6 * 16, 16), (16, 32)))
    for arr in (x, w, bias):
        arr[...] = rng.standard_normal(arr.size)
    aux = np.zeros(6 * 24, np.float32)
    px, pw, py, pb, paux = bind(fake, x, w, y, bias, aux)
    lib.gemm(Req("nt", 6, 16, 5, precision="tf32", epilogue="gelu_aux_bias", aux_ld=24), a=px, b=pw, c=py,
             bias=pb, aux=paux)
    (desc,) = [fake.objects[h] for h in fake.live("desc")]
    assert desc["COMPUTE_TYPE"] == 77 and desc["SCALE_TYPE"] == 0  # COMPUTE_32F_FAST_TF32, CUDA_R_32F
    assert (desc["TRANSA"], desc["TRANSB"], desc["EPILOGUE"]) == (1, 0, 164)  # T, N, GELU_AUX_BIAS
    assert (desc["BIAS_POINTER"], desc["EPILOGUE_AUX_POINTER"], desc["EPILOGUE_AUX_LD"]) == (pb, paux, 24)
    (pref,) = [fake.objects[h] for h in fake.live("pref")]
    assert pref["MAX_WORKSPACE_BYTES"] == 4096
    assert (pref["MIN_ALIGNMENT_A_BYTES"], pref["MIN_ALIGNMENT_B_BYTES"], pref["MIN_ALIGNMENT_C_BYTES"]) == (256, 4, 16)
    assert pref["REDUCTION_SCHEME_MASK"] == 6  # COMPUTE_TYPE | OUTPUT_TYPE: no in-place split-K reduction
    mm = matmuls(fake)[0]
    assert (mm["a"], mm["b"], mm["c"], mm["d"]) == (pw, px, py, py)  # cuBLASLt's first operand is W
    np.testing.assert_allclose(y.reshape(6, 16), gelu_tanh(round_tf32(x.reshape(6, 5)) @ round_tf32(
        w.reshape(16, 5)).T + bias), rtol=1e-5, atol=1e-5)
    bias2 = np.ones(16, np.float32)
    (pb2,) = bind(fake, bias2)
    lib.gemm(Req("nt", 6, 16, 5, precision="tf32", epilogue="gelu_aux_bias", aux_ld=24), a=px, b=pw, c=py,
             bias=pb2, aux=paux)  # a second layer's bias: same descriptor, its own pointer
    assert fake.objects[fake.live("desc")[0]]["BIAS_POINTER"] == pb2 and lib.heuristic_queries == 1
    batched = Req("tn", 4, 3, 5, batch=2, stride_a=20, stride_b=15, stride_c=12)
    a2, b2, c2 = (np.zeros(n, np.float32) for n in (40, 30, 24))
    lib.gemm(batched, a=bind(fake, a2)[0], b=bind(fake, b2)[0], c=bind(fake, c2)[0])
    sets = [(args[1], args[2]) for name, args in fake.calls if name == "matrix_layout_set_attribute"]
    assert sets == [("BATCH_COUNT", 2), ("STRIDED_BATCH_OFFSET", 15), ("BATCH_COUNT", 2),
                    ("STRIDED_BATCH_OFFSET", 20), ("BATCH_COUNT", 2), ("STRIDED_BATCH_OFFSET", 12)]
    lib.close()


def test_device_arrays_pass_as_their_pointers(fake):
    x, w, y = np.ones(8, np.float32), np.ones(8, np.float32), np.zeros(4, np.float32)
    bind(fake, x, w, y)
    with cublaslt.Cublaslt() as lib:
        lib.gemm(Req("nt", 2, 2, 4), a=HostArray(x), b=HostArray(w), c=HostArray(y))
    np.testing.assert_array_equal(y, 4.0)
    with pytest.raises(BackendError, match="expected a device array or address, got ndarray"):
        cublaslt.device_pointer(x)


def test_provider_errors_are_one_line(fake, monkeypatch):
    lib = cublaslt.Cublaslt()
    x = np.zeros(64, np.float32)
    (p,) = bind(fake, x)
    with pytest.raises(BackendError, match="epilogue 'bias' needs bias="):
        lib.gemm(Req("nt", 2, 2, 2, epilogue="bias"), a=p, b=p, c=p)
    with pytest.raises(BackendError, match="bias must be 16-byte aligned"):
        lib.gemm(Req("nt", 2, 2, 2, epilogue="bias"), a=p, b=p, c=p, bias=p + 4)
    fake.no_algorithm = True
    with pytest.raises(BackendError, match=r'no algorithm for nt 3x2x2 fp32 .*use cuda.gemm = "numba"') as e:
        lib.gemm(Req("nt", 3, 2, 2), a=p, b=p, c=p)
    assert "\n" not in str(e.value)
    fake.no_algorithm, fake.algo_workspace = False, 1 << 40
    with pytest.raises(BackendError, match="needing 1099511627776 bytes of workspace"):
        lib.gemm(Req("nt", 4, 2, 2), a=p, b=p, c=p)
    lib.close()
    with pytest.raises(BackendError, match="gemm after close"):
        lib.gemm(Req("nt", 2, 2, 2), a=p, b=p, c=p)
    fake.fail_create = RuntimeError("CUDA driver is not found (libcuda.so.1: cannot open shared object file)\nmore")
    with pytest.raises(BackendError) as e:
        cublaslt.Cublaslt()
    assert str(e.value) == ("cuBLASLt could not start: RuntimeError: CUDA driver is not found (libcuda.so.1: "
                            "cannot open shared object file)")


def test_what_cublaslt_cannot_take_is_refused_before_queueing_and_asked_once(fake):
    """``Refused`` (a BackendError) for a misaligned bias and a key without an algorithm: nothing queued, the
    descriptors of the refused key freed, and the heuristic not asked again for that key (the CUDA backend runs
    those products in its numba kernels: tests/cuda/test_cuda_gemm_provider.py)."""
    lib = cublaslt.Cublaslt()
    x = np.zeros(64, np.float32)
    (p,) = bind(fake, x)
    with pytest.raises(cublaslt.Refused, match="bias must be 16-byte aligned"):
        lib.gemm(Req("nt", 2, 2, 2, epilogue="bias"), a=p, b=p, c=p, bias=p + 4)
    fake.no_algorithm = True
    for _ in range(2):
        with pytest.raises(cublaslt.Refused, match="no algorithm for nn 3x2x2 fp32"):
            lib.gemm(Req("nn", 3, 2, 2), a=p, b=p, c=p)
    assert lib.heuristic_queries == 1 and fake.live("desc") == [] and fake.live("layout") == []
    assert not any(c[0] == "matmul" for c in fake.calls)
    fake.no_algorithm = False
    lib.gemm(Req("nn", 3, 2, 3), a=p, b=p, c=p)  # another key: asked, and run
    assert lib.heuristic_queries == 2 and sum(c[0] == "matmul" for c in fake.calls) == 1
    lib.close()


def test_missing_nvmath_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvmath", None)
    with pytest.raises(BackendError, match=r"cuBLASLt needs nvmath-python \(pip install 'hpctrain\[cuda\]'\)"):
        cublaslt.Cublaslt()
    reason = cublaslt.unavailable()
    assert reason.startswith("cuBLASLt needs nvmath-python") and "\n" not in reason


class ProtocolStream:
    def __cuda_stream__(self):
        return (0, 0xDEF0)


def test_stream_pointer():
    assert cublaslt.stream_pointer(None) == 0 and cublaslt.stream_pointer(5) == 5
    assert cublaslt.stream_pointer(FakeStream()) == 0xABC0 and cublaslt.stream_pointer(ProtocolStream()) == 0xDEF0
    with pytest.raises(BackendError, match="expected a CUDA stream, got str"):
        cublaslt.stream_pointer("default")


# --------------------------------------------------------------------------- 3. the real bindings


def test_real_bindings_have_every_name_value_and_dtype_the_provider_uses():
    lt = pytest.importorskip("nvmath.bindings.cublasLt", reason="nvmath-python not installed (pip install "
                             "'hpctrain[cuda]')")
    import nvmath
    from nvmath.bindings import cublas

    import cublaslt_fake as f

    missing = [n for n in USED_FUNCTIONS if not callable(getattr(lt, n, None))]
    assert not missing, f"nvmath.bindings.cublasLt lacks {missing}"
    for fake_enum, real_enum in ((f.Epilogue, lt.Epilogue), (f.MatmulDescAttribute, lt.MatmulDescAttribute),
                                 (f.MatrixLayoutAttribute, lt.MatrixLayoutAttribute),
                                 (f.MatmulPreferenceAttribute, lt.MatmulPreferenceAttribute),
                                 (f.ReductionScheme, lt.ReductionScheme), (f.ComputeType, cublas.ComputeType),
                                 (f.CudaDataType, nvmath.CudaDataType)):
        for m in fake_enum:
            assert int(real_enum[m.name]) == int(m), f"{real_enum.__name__}.{m.name}"
    for name, dt in f.DESC_DTYPES.items():
        assert np.dtype(lt.get_matmul_desc_attribute_dtype(lt.MatmulDescAttribute[name])) == np.dtype(dt), name
    for name, dt in f.LAYOUT_DTYPES.items():
        assert np.dtype(lt.get_matrix_layout_attribute_dtype(lt.MatrixLayoutAttribute[name])) == np.dtype(dt), name
    for name, dt in f.PREF_DTYPES.items():
        got = lt.get_matmul_preference_attribute_dtype(lt.MatmulPreferenceAttribute[name])
        assert np.dtype(got) == np.dtype(dt), name
    assert np.dtype(lt.matmul_heuristic_result_dtype) == f.HEURISTIC_DTYPE
    for _, (epi, _) in cublaslt.EPILOGUES.items():
        assert epi in lt.Epilogue.__members__
    for _, (_, compute) in cublaslt.PRECISIONS.items():
        assert compute in cublas.ComputeType.__members__
    reason = cublaslt.unavailable()  # here: None on a GPU machine, else one line naming the cause
    assert reason is None or ("\n" not in reason and reason.startswith("cuBLASLt"))
