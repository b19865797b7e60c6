"""cuBLASLt without a GPU: a numpy emulator of its column-major semantics, and a fake of nvmath's bindings.

``emulate(call, a, b, c, bias=, aux=)`` runs one planned call (hpctrain/backend/cuda/gemm/cublaslt.py) on flat
host arrays the way cuBLASLt reads and writes device memory: each operand is a column-major rows×cols matrix
at leading dimension ld (element (i, j) at ``i + j·ld``), ``batch`` of them ``stride`` elements apart, op
applied per transa/transb, D = epilogue(alpha·op(A)·op(B) + beta·C) stored back into ``c``. Arithmetic is
float64 on the stored values (TF32 compute rounds the inputs to 10 mantissa bits first), results cast to the
storage type. An access past a buffer's end raises, so a plan with a wrong ld or stride cannot pass.

``FakeCublasLt`` stands in for ``nvmath.bindings.cublasLt``: the same function names, enum members and
attribute dtypes (tests/test_cublaslt.py checks them against the real module where it is installed), each
call recorded; ``matmul`` reads the descriptors it was given and runs ``emulate`` on the host arrays that
``memory`` maps addresses to.

``SimulatorCublaslt`` stands in for the provider itself (``cublaslt.Cublaslt``) inside a CudaBackend under the CUDA
simulator, whose device arrays are host memory: each ``gemm`` is planned by ``cublaslt.plan`` and run by
``emulate`` on the arrays' own memory, recorded in ``calls``; it refuses what the real one refuses before
queueing (a bias short of 16-byte alignment) and, for the tests of the backend's fallback, what ``refuse`` names.
"""

import ctypes
import enum
import itertools

import ml_dtypes
import numpy as np

STORAGE = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
GELU_C = np.sqrt(2.0 / np.pi)


def gelu_tanh(x):
    """GELU, tanh approximation (what cuBLASLt's GELU epilogues compute)."""
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * x ** 3)))


def gelu_tanh_grad(x):
    t = np.tanh(GELU_C * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * x * x)


def round_tf32(x):
    """float32 values rounded to TF32's 10 mantissa bits (to nearest, ties to even)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def col_major(flat, rows, cols, ld, offset=0):
    """The column-major rows×cols matrix at ``offset`` in ``flat`` (a view; raises if it runs off the end)."""
    if ld < rows:
        raise ValueError(f"ld {ld} < rows {rows}")
    last = offset + (rows - 1) + (cols - 1) * ld
    if offset < 0 or last >= flat.size:
        raise IndexError(f"column-major {rows}x{cols} ld {ld} at {offset} reads element {last} of {flat.size}")
    isz = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], shape=(rows, cols), strides=(isz, ld * isz),
                                           writeable=flat.flags.writeable)


def emulate(call, a, b, c, bias=None, aux=None):
    """Run ``call`` (a CublasltCall) on flat arrays: ``a``/``b`` its first/second operand, ``c`` C and D."""
    for name, arr, lay in (("a", a, call.a), ("b", b, call.b), ("c", c, call.c)):
        if arr.dtype != STORAGE[lay.dtype]:
            raise TypeError(f"operand {name} is {arr.dtype}, layout says {lay.dtype}")
    tf32 = call.compute == "COMPUTE_32F_FAST_TF32"
    for z in range(call.c.batch):
        A = col_major(a, call.a.rows, call.a.cols, call.a.ld, z * call.a.stride).astype(np.float64)
        B = col_major(b, call.b.rows, call.b.cols, call.b.ld, z * call.b.stride).astype(np.float64)
        if tf32:
            A, B = round_tf32(A), round_tf32(B)
        opA = A.T if call.transa == "T" else A
        opB = B.T if call.transb == "T" else B
        if opA.shape != (call.m, call.k) or opB.shape != (call.k, call.n):
            raise ValueError(f"op(A) {opA.shape} op(B) {opB.shape} for m,n,k {call.m},{call.n},{call.k}")
        D = col_major(c, call.c.rows, call.c.cols, call.c.ld, z * call.c.stride)
        if D.shape != (call.m, call.n):
            raise ValueError(f"D {D.shape} for m,n {call.m},{call.n}")
        need = {"BIAS": call.m, "GELU_AUX_BIAS": call.m, "BGRADB": call.n}.get(call.epilogue)
        if need is not None and (bias is None or bias.size != need):
            raise ValueError(f"{call.epilogue} needs a bias of {need}, got {None if bias is None else bias.size}")
        acc = call.alpha * (opA @ opB)
        if call.beta:
            acc = acc + call.beta * D.astype(np.float64)
        if call.epilogue in ("BIAS", "GELU_AUX_BIAS"):
            acc = acc + bias.astype(np.float64)[:, None]
        if call.epilogue == "GELU_AUX_BIAS":
            col_major(aux, call.m, call.n, call.aux_ld)[...] = acc.astype(aux.dtype)
            acc = gelu_tanh(acc)
        elif call.epilogue == "DGELU":
            acc = acc * gelu_tanh_grad(col_major(aux, call.m, call.n, call.aux_ld).astype(np.float64))
        elif call.epilogue == "BGRADB":
            bias[...] = opB.sum(axis=0).astype(bias.dtype)
        elif call.epilogue not in ("DEFAULT", "BIAS"):
            raise ValueError(f"epilogue {call.epilogue} is not emulated")
        D[...] = acc.astype(c.dtype)


# --------------------------------------------------------------------------- the fake bindings

def _enum(name, members):
    return enum.IntEnum(name, members)


# the values and attribute dtypes of nvmath-python 1.0's bindings (checked against the real module)
Epilogue = _enum("Epilogue", {"DEFAULT": 1, "BIAS": 4, "GELU_AUX_BIAS": 164, "DGELU": 192, "BGRADB": 512})
MatmulDescAttribute = _enum("MatmulDescAttribute", {"COMPUTE_TYPE": 0, "SCALE_TYPE": 1, "TRANSA": 3, "TRANSB": 4,
                                                    "EPILOGUE": 7, "BIAS_POINTER": 8, "EPILOGUE_AUX_POINTER": 11,
                                                    "EPILOGUE_AUX_LD": 12})
MatrixLayoutAttribute = _enum("MatrixLayoutAttribute", {"BATCH_COUNT": 5, "STRIDED_BATCH_OFFSET": 6})
MatmulPreferenceAttribute = _enum("MatmulPreferenceAttribute", {
    "MAX_WORKSPACE_BYTES": 1, "REDUCTION_SCHEME_MASK": 3, "MIN_ALIGNMENT_A_BYTES": 5, "MIN_ALIGNMENT_B_BYTES": 6,
    "MIN_ALIGNMENT_C_BYTES": 7, "MIN_ALIGNMENT_D_BYTES": 8})
ReductionScheme = _enum("ReductionScheme", {"NONE": 0, "INPLACE": 1, "COMPUTE_TYPE": 2, "OUTPUT_TYPE": 4, "MASK": 7})
ComputeType = _enum("ComputeType", {"COMPUTE_32F": 68, "COMPUTE_32F_FAST_TF32": 77})
CudaDataType = _enum("CudaDataType", {"CUDA_R_32F": 0, "CUDA_R_16BF": 14})
DESC_DTYPES = {"COMPUTE_TYPE": np.int32, "SCALE_TYPE": np.int32, "TRANSA": np.int32, "TRANSB": np.int32,
               "EPILOGUE": np.uint32, "BIAS_POINTER": np.int64, "EPILOGUE_AUX_POINTER": np.int64,
               "EPILOGUE_AUX_LD": np.int64}
LAYOUT_DTYPES = {"BATCH_COUNT": np.int32, "STRIDED_BATCH_OFFSET": np.int64}
PREF_DTYPES = {"MAX_WORKSPACE_BYTES": np.uint64, "REDUCTION_SCHEME_MASK": np.uint32,
               "MIN_ALIGNMENT_A_BYTES": np.uint32, "MIN_ALIGNMENT_B_BYTES": np.uint32,
               "MIN_ALIGNMENT_C_BYTES": np.uint32, "MIN_ALIGNMENT_D_BYTES": np.uint32}
HEURISTIC_DTYPE = np.dtype([("algo", [("data_", "<u8", (8,))]), ("workspace_size", "<u8"), ("state", "<i4"),
                            ("waves_count", "<f4"), ("reserved", "<i4", (4,))])
DTYPE_NAMES = {0: "fp32", 14: "bf16"}
COMPUTE_NAMES = {68: "COMPUTE_32F", 77: "COMPUTE_32F_FAST_TF32"}


def _read(ptr, size, dtype):
    raw = (ctypes.c_char * size).from_address(ptr).raw
    return np.frombuffer(raw, dtype=dtype)[0].item()


class FakeCublasLt:
    """A recording stand-in for ``nvmath.bindings.cublasLt`` running matmul through ``emulate``.

    ``memory``: address -> flat host array standing in for device memory. ``algo_workspace``: the workspace
    the fake heuristic says its algorithm needs; ``no_algorithm``: the heuristic finds none.
    """

    Epilogue, MatmulDescAttribute, MatrixLayoutAttribute = Epilogue, MatmulDescAttribute, MatrixLayoutAttribute
    MatmulPreferenceAttribute, ReductionScheme = MatmulPreferenceAttribute, ReductionScheme
    matmul_heuristic_result_dtype = HEURISTIC_DTYPE

    def __init__(self):
        self.calls = []  # (function name, args)
        self.objects = {}  # handle -> {"kind": ..., attributes}
        self.memory = {}
        self.algo_workspace = 1024
        self.no_algorithm = False
        self.fail_create = None
        self._ids = itertools.count(0x1000, 0x10)

    def _new(self, kind, **attrs):
        h = next(self._ids)
        self.objects[h] = dict(kind=kind, **attrs)
        return h

    def _log(self, name, *args):
        self.calls.append((name, args))

    def live(self, kind):
        return [h for h, o in self.objects.items() if o["kind"] == kind]

    # -- the bindings' functions
    def get_version(self):
        return 120900

    def create(self):
        self._log("create")
        if self.fail_create:
            raise self.fail_create
        return self._new("handle")

    def destroy(self, h):
        self._log("destroy", h)
        assert self.objects.pop(h)["kind"] == "handle"

    def get_matmul_desc_attribute_dtype(self, attr):
        return DESC_DTYPES[MatmulDescAttribute(attr).name]

    def get_matrix_layout_attribute_dtype(self, attr):
        return LAYOUT_DTYPES[MatrixLayoutAttribute(attr).name]

    def get_matmul_preference_attribute_dtype(self, attr):
        return PREF_DTYPES[MatmulPreferenceAttribute(attr).name]

    def matmul_desc_create(self, compute_type, scale_type):
        self._log("matmul_desc_create", compute_type, scale_type)
        return self._new("desc", COMPUTE_TYPE=int(compute_type), SCALE_TYPE=int(scale_type), TRANSA=0, TRANSB=0,
                         EPILOGUE=1)

    def matmul_desc_set_attribute(self, desc, attr, buf, size):
        name = MatmulDescAttribute(attr).name
        value = _read(buf, size, DESC_DTYPES[name])
        self._log("matmul_desc_set_attribute", desc, name, value)
        self.objects[desc][name] = value

    def matmul_desc_destroy(self, desc):
        self._log("matmul_desc_destroy", desc)
        assert self.objects.pop(desc)["kind"] == "desc"

    def matrix_layout_create(self, dtype, rows, cols, ld):
        self._log("matrix_layout_create", dtype, rows, cols, ld)
        return self._new("layout", dtype=DTYPE_NAMES[int(dtype)], rows=rows, cols=cols, ld=ld, BATCH_COUNT=1,
                         STRIDED_BATCH_OFFSET=0)

    def matrix_layout_set_attribute(self, layout, attr, buf, size):
        name = MatrixLayoutAttribute(attr).name
        value = _read(buf, size, LAYOUT_DTYPES[name])
        self._log("matrix_layout_set_attribute", layout, name, value)
        self.objects[layout][name] = value

    def matrix_layout_destroy(self, layout):
        self._log("matrix_layout_destroy", layout)
        assert self.objects.pop(layout)["kind"] == "layout"

    def matmul_preference_create(self):
        self._log("matmul_preference_create")
        return self._new("pref")

    def matmul_preference_set_attribute(self, pref, attr, buf, size):
        name = MatmulPreferenceAttribute(attr).name
        value = _read(buf, size, PREF_DTYPES[name])
        self._log("matmul_preference_set_attribute", pref, name, value)
        self.objects[pref][name] = value

    def matmul_preference_destroy(self, pref):
        self._log("matmul_preference_destroy", pref)
        assert self.objects.pop(pref)["kind"] == "pref"

    def matmul_algo_get_heuristic(self, handle, desc, adesc, bdesc, cdesc, ddesc, pref, requested, results, count):
        self._log("matmul_algo_get_heuristic", handle, desc, adesc, bdesc, cdesc, ddesc, pref, requested)
        out = np.frombuffer((ctypes.c_char * (HEURISTIC_DTYPE.itemsize * requested)).from_address(results),
                            dtype=HEURISTIC_DTYPE)
        n = np.frombuffer((ctypes.c_char * 4).from_address(count), dtype=np.int32)
        if self.no_algorithm:
            n[0] = 0
            return
        algo_id = next(self._ids)
        out["algo"]["data_"][0, 0] = algo_id
        out["workspace_size"][0] = self.algo_workspace
        out["state"][0] = 0
        n[0] = 1
        self.objects[desc]["algo_issued"] = algo_id

    def matmul(self, handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, workspace,
               workspace_size, stream):
        algo_id = int(np.frombuffer((ctypes.c_char * 8).from_address(algo), dtype=np.uint64)[0])
        self._log("matmul", dict(handle=handle, desc=desc, a=a, b=b, c=c, d=d, adesc=adesc, bdesc=bdesc,
                                 cdesc=cdesc, ddesc=ddesc, algo=algo_id, workspace=workspace,
                                 workspace_size=workspace_size, stream=stream))
        assert self.objects[handle]["kind"] == "handle"
        dsc = self.objects[desc]
        assert dsc["kind"] == "desc" and algo_id == dsc["algo_issued"], "matmul with another shape's algorithm"
        assert c == d and cdesc == ddesc, "C and D are one buffer"
        assert workspace_size >= self.algo_workspace
        call = self.call_of(desc, adesc, bdesc, cdesc, _read(alpha, 4, np.float32), _read(beta, 4, np.float32))
        bias = self.memory.get(dsc.get("BIAS_POINTER"))
        aux = self.memory.get(dsc.get("EPILOGUE_AUX_POINTER"))
        emulate(call, self.memory[a], self.memory[b], self.memory[c], bias=bias, aux=aux)

    def call_of(self, desc, adesc, bdesc, cdesc, alpha, beta):
        """The CublasltCall the descriptors describe (what cuBLASLt would be asked to do)."""
        from cublaslt_load import cublaslt

        dsc = self.objects[desc]
        lays = []
        for h in (adesc, bdesc, cdesc):
            o = self.objects[h]
            lays.append(cublaslt.Layout(o["dtype"], o["rows"], o["cols"], o["ld"], o["BATCH_COUNT"],
                                        o["STRIDED_BATCH_OFFSET"]))
        a, b, c = lays
        ta, tb = ("T" if dsc[t] == 1 else "N" for t in ("TRANSA", "TRANSB"))
        m, k = (a.cols, a.rows) if ta == "T" else (a.rows, a.cols)
        n = b.rows if tb == "T" else b.cols
        epi = Epilogue(dsc["EPILOGUE"]).name
        return cublaslt.CublasltCall(ta, tb, m, n, k, a, b, c, COMPUTE_NAMES[dsc["COMPUTE_TYPE"]], epi, alpha, beta,
                                     aux_ld=dsc.get("EPILOGUE_AUX_LD", 0))


USED_FUNCTIONS = ("create", "destroy", "get_version", "matmul_desc_create", "matmul_desc_set_attribute",
                  "matmul_desc_destroy", "get_matmul_desc_attribute_dtype", "matrix_layout_create",
                  "matrix_layout_set_attribute", "matrix_layout_destroy", "get_matrix_layout_attribute_dtype",
                  "matmul_preference_create", "matmul_preference_set_attribute", "matmul_preference_destroy",
                  "get_matmul_preference_attribute_dtype", "matmul_algo_get_heuristic", "matmul")


# --------------------------------------------------------------------------- the provider, on simulated arrays


class SimulatorCublaslt:
    """``cublaslt.Cublaslt`` for a CudaBackend under the simulator (module docstring). ``refuse(req)``: a reason
    to raise ``cublaslt.Refused`` with (None: take the call)."""

    def __init__(self, refuse=None):
        self.refuse = refuse
        self.calls = []  # (request, stream, {operand: address})
        self.closed = False

    def gemm(self, req, *, a, b, c, bias=None, aux=None, stream=None):
        self.bind(req, a=a, b=b, c=c, bias=bias, aux=aux).run(stream)

    def bind(self, req, *, a, b, c, bias=None, aux=None):
        """The call on these operands' memory, refused as the real ``bind`` refuses; recorded in ``calls`` and
        emulated when run (by the backend, or by an emulated step graph: graphs.py)."""
        from cublaslt_load import cublaslt

        if self.closed:
            raise AssertionError("gemm after close()")
        arrays = {"a": a, "b": b, "c": c, "bias": bias, "aux": aux}
        host = {name: _host_memory(name, x) for name, x in arrays.items() if x is not None}
        if bias is not None and host["bias"].ctypes.data % cublaslt.EPILOGUE_ALIGN:
            raise cublaslt.Refused(f"cublaslt: bias must be {cublaslt.EPILOGUE_ALIGN}-byte aligned")
        why = self.refuse(req) if self.refuse else None
        if why:
            raise cublaslt.Refused(why)
        return _Bound(self, req, host)

    def close(self):
        self.closed = True


class _Bound:
    def __init__(self, lib, req, host):
        self.lib, self.req, self.host = lib, req, host

    def run(self, stream=None):
        from cublaslt_load import cublaslt

        if self.lib.closed:
            raise AssertionError("gemm after close()")
        host = self.host
        self.lib.calls.append((self.req, stream, {name: x.ctypes.data for name, x in host.items()}))
        emulate(cublaslt.plan(self.req), host["b"], host["a"], host["c"], bias=host.get("bias"),
                aux=host.get("aux"))


def _host_memory(name, x):
    """A simulated device array's memory as a flat numpy view (the provider takes contiguous rows only); bfloat16
    words (uint16, the CUDA backend's bf16 storage) as ml_dtypes' bfloat16."""
    ary = x._ary
    if not ary.flags.c_contiguous:
        raise AssertionError(f"{name}: a strided array of shape {ary.shape} handed to cuBLASLt")
    flat = ary.reshape(-1)
    return flat.view(ml_dtypes.bfloat16) if flat.dtype == np.uint16 else flat
