"""The numba.njit flavours of the CPU kernels, cached on disk (``cache=True``) so a second run does not recompile.

error_model="numpy": a division by zero gives inf/nan (caught by the non-finite checks) instead of raising, which
is what lets LLVM vectorise the loops (the Adam update runs ~7x faster: bench/history/cpu_adam_variants.py). Reductions
may reassociate their sums so they vectorise (``jit_reduce``); the result is still deterministic.
"""

from __future__ import annotations

import numba

__all__ = ["jit", "jit_reduce", "jit_fast"]

jit = numba.njit(cache=True, nogil=True, error_model="numpy")
jit_reduce = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
# GELU's erf polynomial: contractions and approximate functions (cpu/activations.py)
jit_fast = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract", "afn", "nsz", "arcp"})
