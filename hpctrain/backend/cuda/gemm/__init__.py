"""The GEMM providers of the CUDA backend: every matrix product of a step goes through ``Gemm``'s three methods.

    _gemm(layout, a, b, out, M, N, K, bias, epilogue)        c = a·b in layout NT, NN or TN (Linear's products)
    _split_k(tile, a, b, out, M, N, K, splits, accumulate)   a weight gradient under a wave, split along K
    _batched(tile, layout, a, b, c, M, N, K, k_total, H, Z, ao, bo, co, mode)   Z products (attention, split-K)

tiled.py: numba kernels, a shared-memory tiled, register-blocked GEMM per ``GemmTile``, with the tile table and
the choice of tiling and K-splits. The layouts: NT out = a[M,K]·b[N,K]ᵀ, NN out = a[M,K]·b[K,N], TN out =
a[K,M]ᵀ·b[K,N] (tiled.py's kernel order).

cublaslt.py: cuBLASLt, the other provider of ``_gemm``, chosen by ``cuda.gemm`` (``open_provider``). "numba" is
tiled.py alone; "cublaslt" needs cuBLASLt (a one-line BackendError saying why not); "auto" takes it where
``cublaslt_unavailable`` is None and the backend is not the simulator, else tiled.py (``gemm_why`` says why,
get_backend logs it). With cuBLASLt, NT with a bias is one call with the BIAS epilogue (a bias view short of
16-byte alignment copied to an aligned scratch first), TN accumulating is beta = 1, all on the backend's stream
in float32 (request precision "fp32"; "tf32" under ``train.precision = "tf32"``, tiled.py's kernels staying
float32; "bf16" with a float32 output where the operands are bfloat16 words, uint16, under ``train.precision =
"bf16"``: precision.py). A product it cannot take as it is (K = 0, an operand not C-contiguous float32 or
bfloat16, cublaslt.Refused: no algorithm for the operands' alignments) runs in tiled.py's kernels instead
(bfloat16 operands widened to float32 first: ``_widened``),
counted in ``gemm_fallbacks`` (reason -> products; the training step logs each new reason once: train/step.py).
Attention's products with cuBLASLt are strided-batched calls (``_strided``) over heads that attention.py first
copies into contiguous [B·H, T, hs] arrays (a head's operands in qkv sit at two strides, batch and head, which
one strided batch cannot express); cuBLASLt computes each T×T whole where tiled.py's causal modes skip the
tiles above the diagonal. tiled.py's batched kernels (``_batched``) run them with the numba provider, and take a
strided product cuBLASLt refuses.

A cuBLASLt call is bound to its operands' addresses first (``Cublaslt.bind``: refused there, before anything is
queued) and then goes through the step graphs like a kernel launch (``CUBLASLT`` its "kernel" in their keys and in
``launch_trace``): recorded with the step, captured into the segment's graph (the library's kernels enqueued on the
graph builder's capturing stream: launch.py's ``build_graph``) and replayed with it, so it costs no launch from
Python once the graphs replay. The BIAS epilogue's aligned copy of a bias is a kernel (``copy``) for the same
reason.
"""

from __future__ import annotations

import numpy as np

from ....errors import BackendError
from ..launch import traced_arguments
from ..memory import flat
from . import cublaslt
from .tiled import (EPI_ACCUMULATE, MAX_GRID_Z, MODE_PLAIN, MODE_SPLIT_K, batched_gemm_kernels, choose_tile,
                    gemm_kernels, k_splits, launch_config)

__all__ = ["Gemm", "NT", "NN", "TN", "GEMM_CHOICES", "open_provider", "cublaslt_unavailable"]

NT, NN, TN = 0, 1, 2  # the operand layouts, in the order tiled.py returns its kernels
OPS = ("nt", "nn", "tn")  # cuBLASLt's names of the layouts (cublaslt.OPS)
GEMM_CHOICES = ("auto", "cublaslt", "numba")  # cuda.gemm
NO_CUBLASLT_ON_SIM = "the CUDA simulator has no cuBLASLt (its device arrays are host memory)"


def cublaslt_unavailable(simulator: bool) -> str | None:
    """Why this backend cannot use cuBLASLt, in one line, or None."""
    return cublaslt.unavailable() or (NO_CUBLASLT_ON_SIM if simulator else None)


def open_provider(gemm: str, simulator: bool):
    """``cuda.gemm`` resolved: (a cublaslt.Cublaslt or None, "cublaslt" or "numba", why "auto" took numba or "")."""
    if gemm not in GEMM_CHOICES:
        raise BackendError(f"cuda.gemm must be one of {', '.join(map(repr, GEMM_CHOICES))}, got {gemm!r}")
    if gemm == "numba":
        return None, "numba", ""
    # "auto" asks nothing under the simulator (no import of nvmath-python for the kernels' tests)
    why = NO_CUBLASLT_ON_SIM if gemm == "auto" and simulator else cublaslt_unavailable(simulator)
    if why is None:
        try:
            return cublaslt.Cublaslt(), "cublaslt", ""
        except BackendError as e:
            why = str(e)
    if gemm == "cublaslt":
        raise BackendError(f'cuda.gemm = "cublaslt" but {why}; use "auto" or "numba"')
    return None, "numba", why


class Gemm:
    """CudaBackend's GEMM launches (a mixin: ``self.tiles``, ``self.tn_tiles`` and ``self.wave`` choose the
    tiling, ``self._launch`` launches; ``self._cublaslt``: the cuBLASLt provider, None where cuda.gemm took numba)."""

    def _init_gemm(self, gemm: str, tf32: bool = False) -> None:
        """The provider ``cuda.gemm`` names (``open_provider``); ``gemm_provider`` says which one runs. ``tf32``
        (``train.precision = "tf32"``): cuBLASLt's products in TF32 (tiled.py's stay float32)."""
        self._cublaslt, self.gemm_provider, self.gemm_why = open_provider(gemm, self.simulator)
        self._lt_precision = "tf32" if tf32 else "fp32"
        self.gemm_fallbacks: dict = {}  # why cuBLASLt could not take a product -> how many it could not

    def use_numba(self, why: str) -> None:
        """tiled.py's kernels for every product from now on, cuBLASLt's handle closed (``cuda.gemm = "auto"``
        where another rank has no cuBLASLt: train/startup.py's ``agree_gemm``)."""
        if self._cublaslt is not None:
            self._cublaslt.close()
        self._cublaslt, self.gemm_provider, self.gemm_why = None, "numba", why

    def _gemm(self, layout, a, b, out, M, N, K, bias, epilogue):
        if M == 0 or N == 0:
            return
        if self._cublaslt is not None and self._cublaslt_gemm(layout, a, b, out, M, N, K, bias, epilogue):
            return
        a, b = self._widened(a), self._widened(b)  # tiled.py's kernels read float32
        tile = choose_tile(self.tn_tiles if layout == TN else self.tiles, self.wave, M, N)
        splits = k_splits(tile, self.wave, M, N, K) if layout == TN else 1
        if splits > 1:
            self._split_k(tile, a, b, out, M, N, K, splits, epilogue == EPI_ACCUMULATE)
            return
        grid, threads = launch_config(tile, M, N)
        kernel = gemm_kernels(tile)[layout]
        self._launch(kernel, grid, threads, a, b, out, self._no_bias if bias is None else bias, M, N, K, epilogue)

    def _cublaslt_gemm(self, layout, a, b, out, M, N, K, bias, epilogue) -> bool:
        """The product by cuBLASLt on the stream; False where it cannot take the operands (nothing queued but
        perhaps the bias's aligned copy; counted in ``gemm_fallbacks``): the caller runs tiled.py's kernels."""
        why = _not_for_cublaslt(K, a, b, out, bias)
        if not why:
            bf16 = a.dtype == np.uint16  # train.precision = "bf16": both operands bfloat16 words (precision.py)
            req = cublaslt.GemmRequest(OPS[layout], M, N, K, precision="bf16" if bf16 else self._lt_precision,
                                       out="fp32", epilogue="none" if bias is None else "bias",
                                       accumulate=epilogue == EPI_ACCUMULATE)
            return self._lt_call(req, a, b, out, bias)
        self.gemm_fallbacks[why] = self.gemm_fallbacks.get(why, 0) + 1
        return False

    def _lt_call(self, req, a, b, c, bias) -> bool:
        """``req`` by cuBLASLt on the stream, or recorded into (and replayed by) the step graphs as a launch of its
        own; False where cuBLASLt refuses it (nothing queued but perhaps the bias's aligned copy; counted in
        ``gemm_fallbacks``)."""
        if bias is not None and address(bias) % cublaslt.EPILOGUE_ALIGN:
            bias = self._aligned_bias(bias)
        try:
            bound = self._cublaslt.bind(req, a=a, b=b, c=c, bias=bias)
        except cublaslt.Refused as e:
            self.gemm_fallbacks[str(e)] = self.gemm_fallbacks.get(str(e), 0) + 1
            return False
        args = (req, a, b, c, bias)
        if self.launch_trace is not None:
            self.launch_trace.append((f"cublaslt_{req.op}", None, None, traced_arguments(args)))
        if self.graphs is not None and self.graphs.launch(CUBLASLT, None, None, args, frozen=bound):
            return True  # replayed: it runs with its segment's graph
        bound.run(self.stream)
        self.launches += 1
        return True

    def _strided(self, layout, a, b, c, M, N, K, Z) -> None:
        """Z products c_z = a_z·b_z in ``layout`` of contiguous operands (a [Z·rows, cols], the z-th product's rows
        one after the other: attention's heads), stored, not accumulated: one strided-batched cuBLASLt call where
        it takes them, else tiled.py's batched kernels (bfloat16 operands widened first)."""
        why = _not_for_cublaslt(K, a, b, c, None) if self._cublaslt is not None else None
        if why == "":
            req = cublaslt.GemmRequest(OPS[layout], M, N, K, out="fp32", batch=Z, stride_a=M * K, stride_b=K * N,
                                       stride_c=M * N,
                                       precision="bf16" if a.dtype == np.uint16 else self._lt_precision)
            if self._lt_call(req, a, b, c, None):
                return
        elif why is not None:
            self.gemm_fallbacks[why] = self.gemm_fallbacks.get(why, 0) + 1
        a, b = self._widened(a), self._widened(b)
        a_rows = K if layout == TN else M  # rows of one product's operand as stored
        b_rows = N if layout == NT else K
        self._batched(self.attention_tile, layout, a, b, c, M, N, K, K, 1, Z, (a_rows, 0, 0, 0), (b_rows, 0, 0, 0),
                      (M, 0, 0, 0), MODE_PLAIN)

    def _widened(self, x):
        """``x`` as tiled.py's kernels read it: a bfloat16 operand (uint16 words) as a new float32 array of the
        same values (``from_bf16``), a float32 one as it is."""
        if x.dtype != np.uint16:
            return x
        wide = self._alloc("gemm", x.shape, np.float32)
        self._elementwise(self._k.from_bf16, x.size, flat(x), flat(wide).view(np.uint32))
        return wide

    def _aligned_bias(self, bias):
        """A copy of ``bias`` (a view into the flat parameters, 4-byte aligned) where the BIAS epilogue can read
        it: the backend's allocations start on 512-byte boundaries (memory.py), the simulator's on numpy's 16. A
        kernel's copy, which the step graphs hold like any other launch."""
        copy = self._alloc("matmul_nt", bias.shape, np.float32)
        self._elementwise(self._k.copy, bias.size, bias, copy)
        return copy

    def _split_k(self, tile, a, b, out, M, N, K, splits, accumulate):
        """out[M,N] (+)= a[K,M]ᵀ·b[K,N] as ``splits`` partial products over K slices into a workspace, then
        summed slice by slice in order (deterministic)."""
        ks = -(-K // splits)
        ws = self._alloc("matmul_tn", (splits * M, N), np.float32)
        self._batched(tile, TN, a, b, ws, M, N, ks, K, 1, splits, (ks, 0, 0, 0), (ks, 0, 0, 0), (M, 0, 0, 0),
                      MODE_SPLIT_K)
        sum_splits = batched_gemm_kernels(tile)[3]
        self._launch(sum_splits, self._grid(M * N), self.block, flat(ws), flat(out), splits, bool(accumulate))

    def _batched(self, tile, layout, a, b, c, M, N, K, k_total, H, Z, ao, bo, co, mode):
        """Z batched products (tiled.py's batched kernels), in launches of at most MAX_GRID_Z."""
        kernel = batched_gemm_kernels(tile)[layout]
        for z0 in range(0, Z, MAX_GRID_Z):
            grid, threads = launch_config(tile, M, N, min(MAX_GRID_Z, Z - z0))
            self._launch(kernel, grid, threads, a, b, c, M, N, K, k_total, H, z0, ao, bo, co, mode)


class _Cublaslt:
    """What a cuBLASLt product is to the step graphs' keys and traces: the "kernel" of its launches."""

    __name__ = "cublaslt"

    def __repr__(self):
        return "cublaslt"


CUBLASLT = _Cublaslt()


def address(x) -> int:
    """A device array's address (the simulator's: its host memory's, for the alignment checks)."""
    ary = getattr(x, "_ary", None)
    return ary.__array_interface__["data"][0] if ary is not None else cublaslt.device_pointer(x)


def _not_for_cublaslt(K, a, b, out, bias) -> str:
    """Why cuBLASLt cannot take these operands as they are ("" where it can): a row-major product of C-contiguous
    arrays with K >= 1, the operands both float32 or both bfloat16 words (uint16), out and bias (None: none)
    float32."""
    if K < 1:
        return "K = 0 (cuBLASLt takes K >= 1)"
    if a.dtype != b.dtype or a.dtype not in (np.float32, np.uint16):
        return f"operands {a.dtype} and {b.dtype} (cuBLASLt takes two float32 or two bfloat16)"
    for x, dtype in ((a, a.dtype), (b, a.dtype), (out, np.float32), (bias, np.float32)):
        if x is not None and (x.dtype != dtype or not x.is_c_contiguous()):
            return f"an operand of shape {tuple(x.shape)} is not C-contiguous {np.dtype(dtype).name}"
    return ""
