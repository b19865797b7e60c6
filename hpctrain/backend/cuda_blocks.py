"""Block-wide reductions shared by the CUDA kernels: every thread of a 1-D block gets the result.

    r = block_reducers(nt)        # nt: threads per block, a power of two
    total = r.block_sum(sh, v)    # sh: a cuda.shared.array(nt, ...) of the caller's, reusable at once after
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import cuda

__all__ = ["block_reducers"]


@functools.lru_cache(maxsize=None)
def block_reducers(nt: int) -> SimpleNamespace:
    NT = nt

    @cuda.jit(device=True)
    def block_sum(sh, v):
        """Sum of ``v`` over the block's NT threads (1-D block); every thread gets the total."""
        t = cuda.threadIdx.x
        sh[t] = v
        cuda.syncthreads()
        s = NT // 2
        while s > 0:
            if t < s:
                sh[t] += sh[t + s]
            cuda.syncthreads()
            s //= 2
        total = sh[0]
        cuda.syncthreads()  # so the caller may reuse ``sh`` at once
        return total

    @cuda.jit(device=True)
    def block_max(sh, v):
        """Maximum of ``v`` over the block's NT threads; every thread gets it."""
        t = cuda.threadIdx.x
        sh[t] = v
        cuda.syncthreads()
        s = NT // 2
        while s > 0:
            if t < s and sh[t + s] > sh[t]:
                sh[t] = sh[t + s]
            cuda.syncthreads()
            s //= 2
        best = sh[0]
        cuda.syncthreads()
        return best

    return SimpleNamespace(block_sum=block_sum, block_max=block_max)
