"""The cuBLASLt GEMM provider: row-major products planned onto cuBLASLt's column-major call.

    C[M,N] = op(A)·op(B) (+ epilogue), row-major, float32 accumulation:

    op "nt"  C = A[M,K] · B[N,K]ᵀ  (+ bias[N]; or GELU(· + bias) saving the pre-activation)   Linear forward
    op "nn"  C = A[M,K] · B[K,N]   (or · ⊙ GELU'(aux), the pre-activation saved forward)       input gradient
    op "tn"  C (+)= A[K,M]ᵀ · B[K,N]  (+ dbias[M] = Σ_k A[k,:], written)                      weight gradient

A row-major C[M,N] is the column-major matrix Cᵀ[N,M] with the same bytes, and Cᵀ = op(B)ᵀ·op(A)ᵀ, so the
column-major call takes the row-major B as its first operand ("A" in cuBLASLt's words) and the row-major A as
its second, with m = N, n = M, k = K (llm.c's ``matmul_cublaslt``, apex's ``fused_dense``). A row-major
operand stored [rows, cols] with row stride ``ld`` is the column-major [cols, rows] matrix with the same ld;
cuBLASLt transposes it back where the product needs the other orientation. Epilogues, in cuBLASLt's frame:
BIAS adds a vector over D's rows (m = N: the row-major bias over columns), GELU_AUX_BIAS also writes the
pre-activation to the aux buffer (ld ``aux_ld``, the row-major row stride) and stores GELU of it (the tanh
approximation), DGELU multiplies by GELU' of aux, BGRADB writes the sums of the second operand over k (the
row-major Σ_k A[k, m], length M) beside the product. ``plan`` does that mapping in pure python;
tests/test_cublaslt.py runs every plan through a numpy emulator of cuBLASLt's semantics against the row-major
reference, and drives ``Cublaslt`` against a fake of the bindings.

``Cublaslt`` owns a cuBLASLt handle and a fixed workspace (allocated once), and per request key (the request
and the operands' pointer alignments) a matmul descriptor, four layouts, a preference and the one algorithm
the heuristic chose: one heuristic query per key, then the same algorithm on every call. The preference
excludes split-K "in place" reduction (partial products added into D); split-K through the workspace, summed
by a separate kernel, stays allowed. Same inputs, same GPU model, same library version: same bits. Pointers
are raw device addresses (a numba array's ``__cuda_array_interface__['data'][0]``) and the stream is the
backend's, so no copy or synchronisation is added. nvmath-python's bindings (``nvmath.bindings.cublasLt``,
``pip install 'hpctrain[cuda]'``) are imported when the first ``Cublaslt`` is made; ``unavailable()`` says in
one line why cuBLASLt cannot be used here (no nvmath-python, no driver, no libcublasLt), or None.

``Refused`` (a BackendError) is what ``gemm`` raises, before anything is queued, for operands cuBLASLt cannot take
as they are: an epilogue vector short of 16-byte alignment, a request key the heuristic has no algorithm for (the
answer kept per key: asked once), an algorithm needing more workspace than allowed. The CUDA backend
(gemm/__init__.py) runs that one product with its numba kernels instead; any other error is raised as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpctrain.errors import BackendError

__all__ = ["GemmRequest", "Layout", "CublasltCall", "plan", "Cublaslt", "BoundCall", "Refused", "unavailable", "OPS",
           "EPILOGUES", "PRECISIONS", "WORKSPACE_BYTES", "EPILOGUE_ALIGN"]

OPS = ("nt", "nn", "tn")
# epilogue -> (cuBLASLt epilogue name, the one op it rides on in training)
EPILOGUES = {"none": ("DEFAULT", None), "bias": ("BIAS", "nt"), "gelu_aux_bias": ("GELU_AUX_BIAS", "nt"),
             "dgelu": ("DGELU", "nn"), "bgradb": ("BGRADB", "tn")}
# precision -> (input dtype, compute type); scale type float32 throughout (alpha, beta are float32)
PRECISIONS = {"fp32": ("fp32", "COMPUTE_32F"), "tf32": ("fp32", "COMPUTE_32F_FAST_TF32"),
              "bf16": ("bf16", "COMPUTE_32F")}
DTYPES = {"fp32": ("CUDA_R_32F", 4), "bf16": ("CUDA_R_16BF", 2)}
WORKSPACE_BYTES = 32 << 20  # cuBLAS's own default on Hopper; fixed, so the heuristic's answer is too
EPILOGUE_ALIGN = 16  # bytes, for the bias and aux pointers (cuBLASLt rejects less)


class Refused(BackendError):
    """cuBLASLt cannot take these operands as they are (nothing was queued): use another kernel for this call."""


@dataclass(frozen=True)
class GemmRequest:
    """One row-major product. ``lda``/``ldb``/``ldc``: row strides in elements (default: contiguous rows);
    ``batch`` products at element strides ``stride_a``/``_b``/``_c``; ``accumulate``: C += (beta = 1);
    ``out`` "fp32" or "bf16" (bf16 inputs only; default: the input type); ``aux_ld``: the aux buffer's row
    stride (default N), a multiple of 8."""
    op: str
    M: int
    N: int
    K: int
    precision: str = "fp32"
    out: str | None = None
    epilogue: str = "none"
    accumulate: bool = False
    alpha: float = 1.0
    lda: int | None = None
    ldb: int | None = None
    ldc: int | None = None
    batch: int = 1
    stride_a: int = 0
    stride_b: int = 0
    stride_c: int = 0
    aux_ld: int | None = None


@dataclass(frozen=True)
class Layout:
    """A cuBLASLt matrix layout: column-major rows×cols, leading dimension ld, ``batch`` at ``stride``."""
    dtype: str
    rows: int
    cols: int
    ld: int
    batch: int = 1
    stride: int = 0


@dataclass(frozen=True)
class CublasltCall:
    """The column-major call for a request. Its first operand ``a`` is the row-major B and its second ``b``
    the row-major A; ``c`` is both C and D (accumulate reads it). ``bias_len``: the epilogue's vector
    (added for BIAS/GELU_AUX_BIAS, written for BGRADB), 0 if none; ``aux_ld``: 0 if no aux buffer."""
    transa: str
    transb: str
    m: int
    n: int
    k: int
    a: Layout
    b: Layout
    c: Layout
    compute: str
    epilogue: str
    alpha: float
    beta: float
    bias_len: int = 0
    aux_ld: int = 0


def _positive(name, v, low=1):
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < low:
        raise BackendError(f"cublaslt: {name} must be an integer >= {low}, got {v!r}")
    return int(v)


def plan(req: GemmRequest) -> CublasltCall:
    """The column-major cuBLASLt call computing ``req`` (pure python; raises BackendError naming the field)."""
    if req.op not in OPS:
        raise BackendError(f"cublaslt: op must be one of {OPS}, got {req.op!r}")
    if req.precision not in PRECISIONS:
        raise BackendError(f"cublaslt: precision must be one of {tuple(PRECISIONS)}, got {req.precision!r}")
    if req.epilogue not in EPILOGUES:
        raise BackendError(f"cublaslt: epilogue must be one of {tuple(EPILOGUES)}, got {req.epilogue!r}")
    M, N, K = (_positive(n, getattr(req, n)) for n in "MNK")
    batch = _positive("batch", req.batch)
    dt, compute = PRECISIONS[req.precision]
    out = req.out or dt
    if out not in DTYPES or (out != dt and dt != "bf16"):
        raise BackendError(f"cublaslt: out {out!r} with {req.precision} inputs (fp32 inputs give fp32, bf16 "
                           "inputs bf16 or fp32)")
    epi, epi_op = EPILOGUES[req.epilogue]
    if epi_op is not None:
        if req.op != epi_op:
            raise BackendError(f"cublaslt: epilogue {req.epilogue!r} rides on op {epi_op!r}, got {req.op!r}")
        if batch != 1:
            raise BackendError(f"cublaslt: epilogue {req.epilogue!r} needs batch 1, got {batch}")
        if req.accumulate and req.epilogue != "bgradb":
            raise BackendError(f"cublaslt: epilogue {req.epilogue!r} cannot accumulate into C")
    a_rows, a_cols = (M, K) if req.op[0] == "n" else (K, M)  # row-major A as stored
    b_rows, b_cols = (N, K) if req.op[1] == "t" else (K, N)  # row-major B as stored
    lda = _positive("lda", a_cols if req.lda is None else req.lda, a_cols)
    ldb = _positive("ldb", b_cols if req.ldb is None else req.ldb, b_cols)
    ldc = _positive("ldc", N if req.ldc is None else req.ldc, N)
    strides = [_positive(n, getattr(req, n), 0) for n in ("stride_a", "stride_b", "stride_c")]
    if batch == 1:
        strides = [0, 0, 0]
    aux_ld = 0
    if req.epilogue in ("gelu_aux_bias", "dgelu"):
        aux_ld = _positive("aux_ld", N if req.aux_ld is None else req.aux_ld, N)
        if aux_ld % 8:
            raise BackendError(f"cublaslt: aux_ld must be a multiple of 8 (cuBLASLt's rule), got {aux_ld}")
    # row-major [rows, cols] at row stride ld == column-major [cols, rows] at the same ld
    first = Layout(dt, b_cols, b_rows, ldb, batch, strides[1])
    second = Layout(dt, a_cols, a_rows, lda, batch, strides[0])
    c = Layout(out, N, M, ldc, batch, strides[2])
    bias_len = {"bias": N, "gelu_aux_bias": N, "bgradb": M}.get(req.epilogue, 0)
    return CublasltCall(transa="T" if req.op[1] == "t" else "N", transb="T" if req.op[0] == "t" else "N",
                        m=N, n=M, k=K, a=first, b=second, c=c, compute=compute, epilogue=epi,
                        alpha=float(req.alpha), beta=1.0 if req.accumulate else 0.0, bias_len=bias_len,
                        aux_ld=aux_ld)


# --------------------------------------------------------------------------- the bindings


class _Bindings:
    """nvmath-python's modules the provider uses: the cuBLASLt bindings and the two enums it takes from
    elsewhere (compute types from cuBLAS, data types from nvmath)."""

    def __init__(self, lt, compute_type, data_type):
        self.lt, self.compute_type, self.data_type = lt, compute_type, data_type


def _load() -> _Bindings:
    try:
        import nvmath
        from nvmath.bindings import cublas, cublasLt
    except ImportError as e:
        raise BackendError(f"cuBLASLt needs nvmath-python (pip install 'hpctrain[cuda]'): {e}") from None
    return _Bindings(cublasLt, cublas.ComputeType, nvmath.CudaDataType)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def unavailable() -> str | None:
    """Why cuBLASLt cannot be used on this machine, in one line, or None when it can (for cuda.gemm = "auto")."""
    try:
        lib = _load()
        lib.lt.get_version()  # loads the driver and libcublasLt
    except BackendError as e:
        return str(e)
    except Exception as e:  # nvmath raises its own types for a missing driver or library
        return f"cuBLASLt cannot load: {_first_line(e)}"
    return None


def _alloc_workspace(nbytes: int):
    from numba import cuda

    return cuda.device_array(nbytes, dtype=np.uint8)


def device_pointer(x) -> int:
    """A raw device address: an int as it is, else ``__cuda_array_interface__['data'][0]``."""
    if isinstance(x, (int, np.integer)):
        return int(x)
    try:
        return int(x.__cuda_array_interface__["data"][0])
    except AttributeError:
        raise BackendError(f"cublaslt: expected a device array or address, got {type(x).__name__}") from None


def stream_pointer(stream) -> int:
    """A cudaStream_t as an int: an int as it is, 0 (the default stream) for None, else the CUDA stream
    protocol's ``__cuda_stream__()`` (numba-cuda's Stream, CuPy's, PyTorch's) or ``int(stream.handle)``."""
    if stream is None:
        return 0
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    handle = getattr(stream, "handle", None)
    if handle is None:
        raise BackendError(f"cublaslt: expected a CUDA stream, got {type(stream).__name__}")
    value = getattr(handle, "value", handle)  # a ctypes c_void_p (older numba) or a driver handle
    return int(value or 0)


def _alignment(ptr: int) -> int:
    """The largest power of two dividing ``ptr``, at most 256 (cuBLASLt's default assumption)."""
    return 256 if ptr % 256 == 0 else ptr & -ptr


class _Prepared:
    """What one request key owns: descriptors, layouts, preference, the chosen algorithm, alpha and beta."""

    def __init__(self, call, matmul_desc, layouts, pref, heuristic, alpha, beta):
        self.call, self.matmul_desc, self.layouts, self.pref = call, matmul_desc, layouts, pref
        self.heuristic, self.alpha, self.beta = heuristic, alpha, beta


class Cublaslt:
    """cuBLASLt on one device: ``gemm(req, a=, b=, c=, stream=)`` enqueues one row-major product.

    Not thread-safe (one per backend, used from the thread that launches its kernels). ``close()`` frees the
    descriptors and the handle; the workspace goes with the object.
    """

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        self._lib = _load()
        self._handle = None
        try:
            self._handle = self._lib.lt.create()
        except Exception as e:
            raise BackendError(f"cuBLASLt could not start: {_first_line(e)}") from None
        self.workspace_bytes = _positive("workspace_bytes", workspace_bytes)
        self._workspace = _alloc_workspace(self.workspace_bytes)
        self._workspace_ptr = device_pointer(self._workspace)
        self._prepared: dict = {}
        self._refused: dict = {}  # request key -> why the heuristic gave no usable algorithm (asked once)
        self.heuristic_queries = 0

    # -- one call

    def gemm(self, req: GemmRequest, *, a, b, c, bias=None, aux=None, stream=None) -> None:
        """Enqueue ``req`` on ``stream``: c (+)= op(a)·op(b) with the request's epilogue, whose vector is
        ``bias`` (read for bias/gelu_aux_bias, written for bgradb) and whose pre-activation buffer is ``aux``
        (written for gelu_aux_bias, read for dgelu)."""
        self.bind(req, a=a, b=b, c=c, bias=bias, aux=aux).run(stream)

    def bind(self, req: GemmRequest, *, a, b, c, bias=None, aux=None) -> "BoundCall":
        """``req`` on these operands, ready to enqueue (``run(stream)``) on any stream, or on a graph builder's
        while it captures (the step graphs: backend/cuda/graphs.py); it holds addresses, no array. Raises
        Refused (nothing queued) as ``gemm`` does."""
        if self._handle is None:
            raise BackendError("cublaslt: gemm after close()")
        ptrs = {"a": device_pointer(a), "b": device_pointer(b), "c": device_pointer(c)}
        epi = req.epilogue
        if epi in ("bias", "gelu_aux_bias", "bgradb"):
            ptrs["bias"] = self._epilogue_pointer(req, "bias", bias)
        if epi in ("gelu_aux_bias", "dgelu"):
            ptrs["aux"] = self._epilogue_pointer(req, "aux", aux)
        key = (req, tuple(_alignment(ptrs[n]) for n in "abc"))
        prep = self._prepared.get(key)
        if prep is None:
            if key in self._refused:
                raise Refused(self._refused[key])
            try:
                prep = self._prepared[key] = self._prepare(req, *key[1])
            except Refused as e:
                self._refused[key] = str(e)
                raise
        return BoundCall(self, req, prep, ptrs)

    def _run(self, req, prep, ptrs, stream) -> None:
        if self._handle is None:
            raise BackendError("cublaslt: gemm after close()")
        lt = self._lib.lt
        attr = lt.MatmulDescAttribute
        if "bias" in ptrs:
            self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, prep.matmul_desc,
                      attr.BIAS_POINTER, ptrs["bias"])
        if "aux" in ptrs:
            self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, prep.matmul_desc,
                      attr.EPILOGUE_AUX_POINTER, ptrs["aux"])
        la, lb, lc = prep.layouts
        sp = stream_pointer(stream)
        try:  # cuBLASLt's A is the row-major B (module docstring); C and D are one buffer
            lt.matmul(self._handle, prep.matmul_desc, prep.alpha.ctypes.data, ptrs["b"], la, ptrs["a"], lb,
                      prep.beta.ctypes.data, ptrs["c"], lc, ptrs["c"], lc, prep.heuristic.ctypes.data,
                      self._workspace_ptr, self.workspace_bytes, sp)
        except Exception as e:
            raise BackendError(f"cuBLASLt matmul {_describe(req)} failed: {_first_line(e)}") from None

    def _epilogue_pointer(self, req, name, x):
        if x is None:
            raise BackendError(f"cublaslt: epilogue {req.epilogue!r} needs {name}=")
        p = device_pointer(x)
        if p % EPILOGUE_ALIGN:
            raise Refused(f"cublaslt: {name} must be {EPILOGUE_ALIGN}-byte aligned for epilogue "
                               f"{req.epilogue!r} (address {p:#x}); use the unfused path")
        return p

    # -- one request key

    @staticmethod
    def _set(setter, dtype_of, obj, attr, value):
        buf = np.array([value], dtype=dtype_of(attr))
        setter(obj, attr, buf.ctypes.data, buf.nbytes)

    def _prepare(self, req, align_a, align_b, align_c) -> _Prepared:
        call = plan(req)
        lib, lt = self._lib, self._lib.lt
        D, L, P = lt.MatmulDescAttribute, lt.MatrixLayoutAttribute, lt.MatmulPreferenceAttribute
        desc = lt.matmul_desc_create(lib.compute_type[call.compute], lib.data_type.CUDA_R_32F)
        layouts = []
        try:
            def setd(at, v):
                self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc, at, v)

            op = lambda t: 1 if t == "T" else 0  # noqa: E731  (cublasOperation_t: N 0, T 1)
            setd(D.TRANSA, op(call.transa))
            setd(D.TRANSB, op(call.transb))
            setd(D.EPILOGUE, lt.Epilogue[call.epilogue])
            if call.aux_ld:
                setd(D.EPILOGUE_AUX_LD, call.aux_ld)
            for lay in (call.a, call.b, call.c):
                handle = lt.matrix_layout_create(lib.data_type[DTYPES[lay.dtype][0]], lay.rows, lay.cols, lay.ld)
                layouts.append(handle)
                if lay.batch > 1:
                    for at, v in ((L.BATCH_COUNT, lay.batch), (L.STRIDED_BATCH_OFFSET, lay.stride)):
                        self._set(lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype, handle,
                                  at, v)
            pref = lt.matmul_preference_create()
            def setp(at, v):
                self._set(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype, pref, at, v)

            setp(P.MAX_WORKSPACE_BYTES, self.workspace_bytes)
            setp(P.REDUCTION_SCHEME_MASK, int(lt.ReductionScheme.MASK) & ~int(lt.ReductionScheme.INPLACE))
            # cuBLASLt's first operand is the row-major B, its second the row-major A
            for at, v in ((P.MIN_ALIGNMENT_A_BYTES, align_b), (P.MIN_ALIGNMENT_B_BYTES, align_a),
                          (P.MIN_ALIGNMENT_C_BYTES, align_c), (P.MIN_ALIGNMENT_D_BYTES, align_c)):
                setp(at, v)
            heuristic = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
            found = np.zeros(1, dtype=np.int32)
            lt.matmul_algo_get_heuristic(self._handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref,
                                         1, heuristic.ctypes.data, found.ctypes.data)
            self.heuristic_queries += 1
        except BackendError:
            raise
        except Exception as e:
            raise BackendError(f"cuBLASLt set-up of {_describe(req)} failed: {_first_line(e)}") from None
        why = None
        if found[0] < 1 or heuristic["state"][0] != 0:
            why = (f"cuBLASLt has no algorithm for {_describe(req)} (alignments {align_a}/{align_b}/{align_c} "
                   'bytes); use cuda.gemm = "numba"')
        elif heuristic["workspace_size"][0] > self.workspace_bytes:
            why = (f"cuBLASLt chose an algorithm needing {heuristic['workspace_size'][0]} bytes of workspace for "
                   f"{_describe(req)}, over the {self.workspace_bytes} it was allowed")
        if why is not None:
            self._destroy(desc, layouts, pref)
            raise Refused(why)
        alpha, beta = np.array([call.alpha], np.float32), np.array([call.beta], np.float32)
        return _Prepared(call, desc, tuple(layouts), pref, heuristic, alpha, beta)

    def close(self) -> None:
        """Destroy every cached descriptor and the handle (idempotent)."""
        if self._handle is None:
            return
        for prep in self._prepared.values():
            self._destroy(prep.matmul_desc, prep.layouts, prep.pref)
        self._prepared.clear()
        self._lib.lt.destroy(self._handle)
        self._handle = None
        self._workspace = None

    def _destroy(self, desc, layouts, pref) -> None:
        lt = self._lib.lt
        lt.matmul_preference_destroy(pref)
        for lay in layouts:
            lt.matrix_layout_destroy(lay)
        lt.matmul_desc_destroy(desc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BoundCall:
    """One cuBLASLt product bound to its operands' addresses (``Cublaslt.bind``): ``run(stream)`` enqueues it.
    The epilogue pointers are set on the request's descriptor at each run, so a capture holds this call's."""

    __slots__ = ("lib", "req", "prep", "ptrs")

    def __init__(self, lib, req, prep, ptrs):
        self.lib, self.req, self.prep, self.ptrs = lib, req, prep, ptrs

    def run(self, stream=None) -> None:
        self.lib._run(self.req, self.prep, self.ptrs, stream)


def _describe(req: GemmRequest) -> str:
    extra = "" if req.batch == 1 else f" batch {req.batch}"
    epi = "" if req.epilogue == "none" else f" +{req.epilogue}"
    return f"{req.op} {req.M}x{req.N}x{req.K} {req.precision}{extra}{epi}"
