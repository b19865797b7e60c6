"""``out += aᵀ·b`` inside one GEMM (beta = 1): a later micro-batch's weight gradient added where BLAS writes it.

numpy's ``matmul`` has no beta, so ``out += a.T @ b`` makes a temporary the size of ``out`` and adds it in a
second pass: for a 1024 × 1024 weight, 4 MB allocated, faulted in and read twice per micro-batch, 12–15% of
the product's own time (``python bench/bench_accumulate.py``); for a tied GPT-2 token table, 154 MB per
micro-batch (52%). This module calls ``cblas_sgemm`` of the OpenBLAS that numpy itself links, found once by
symbol through numpy's extension module (``dlsym`` searches the libraries it links): numpy's Linux and
macOS-x86 wheels bundle ``scipy_openblas64`` (``scipy_cblas_sgemm64_``), a numpy built against OpenBLAS
may export ``cblas_sgemm64_``; both take 64-bit integers, which their ``64_`` suffix says. Only such
symbols, and scipy-openblas32's ``scipy_cblas_sgemm`` (32-bit integers), are bound: an unsuffixed
``cblas_sgemm`` may take either width (MKL's ILP64 does), and a call with the wrong width can crash rather
than give a wrong result, so it is not tried. A symbol found is then used only after it has multiplied a
small product exactly as numpy does (a wrong argument order shows there). Where none is found (Windows,
where the library is not searched through the extension module; Accelerate; MKL; a build this does not
know), ``Sgemm.find()`` returns None and the caller does it numpy's way: the same sums, one pass slower.

The call goes through ctypes, which releases the GIL, as numpy's own BLAS calls do: another thread (the
gradient sync) runs meanwhile. Threads are OpenBLAS's own, set by ``OMP_NUM_THREADS`` like numpy's.
"""

from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["Sgemm"]

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
# (symbol, integer type) in the order tried: numpy's bundled ILP64 OpenBLAS first; only symbols whose name
# fixes the integer width (see the module's docstring)
_CANDIDATES = (("scipy_cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm64_", ctypes.c_int64),
               ("scipy_cblas_sgemm", ctypes.c_int))


class Sgemm:
    """A row-major ``cblas_sgemm`` bound through ctypes; ``tn_accumulate(a, b, out)``: out[M,N] += a[K,M]ᵀ·b[K,N]."""

    def __init__(self, function, name: str):
        self.function, self.name = function, name

    @classmethod
    def find(cls) -> "Sgemm | None":
        """The first candidate symbol in numpy's BLAS that passes a check product, or None."""
        try:
            from numpy._core import _multiarray_umath as umath
        except ImportError:  # numpy 1.x
            from numpy.core import _multiarray_umath as umath
        try:
            lib = ctypes.CDLL(umath.__file__)  # dlsym on it searches the libraries it links, numpy's BLAS among them
        except OSError:
            return None
        for symbol, integer in _CANDIDATES:
            function = getattr(lib, symbol, None)
            if function is None:
                continue
            function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer, integer, ctypes.c_float,
                                 ctypes.c_void_p, integer, ctypes.c_void_p, integer, ctypes.c_float, ctypes.c_void_p,
                                 integer]
            function.restype = None
            candidate = cls(function, symbol)
            if candidate._agrees_with_numpy():
                return candidate
        return None

    def tn_accumulate(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """out[M,N] += a[K,M]ᵀ·b[K,N]; float32, C-contiguous (the backend's argument checks saw to both)."""
        K, M = a.shape
        N = b.shape[1]
        if K == 0 or out.size == 0:  # nothing to add (and with M = 0 BLAS refuses the leading dimension 0)
            return
        self.function(_ROW_MAJOR, _TRANS, _NO_TRANS, M, N, K, 1.0, a.ctypes.data, M, b.ctypes.data, N, 1.0,
                      out.ctypes.data, N)

    def _agrees_with_numpy(self) -> bool:
        """A 5 × 3 product of small integers added to an integer matrix: exact in float32 whatever the order, so a
        wrong argument order or transposition shows as a mismatch, not as rounding."""
        a = np.arange(15, dtype=np.float32).reshape(5, 3) - 7
        b = np.arange(20, dtype=np.float32).reshape(5, 4) % 7 - 3
        out = np.arange(12, dtype=np.float32).reshape(3, 4)
        expected = out + a.T @ b
        try:
            self.tn_accumulate(a, b, out)
        except (ctypes.ArgumentError, OSError):
            return False
        return bool(np.array_equal(out, expected))
