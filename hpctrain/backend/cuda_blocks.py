"""Block-wide reductions shared by the CUDA kernels: every thread of a 1-D block gets the result.

    r = block_reducers(nt)        # nt: threads per block, a power of two
    total = r.block_sum(sh, v)    # sh: a cuda.shared.array(nt, ...) of the caller's, reusable at once after
    total = r.segment_sum(sh, v)  # over the thread's segment of r.W consecutive threads (r.W = min(32, nt))

Segments are what a warp would reduce with shuffles; they go through shared memory and
block barriers instead, because numba's CUDA simulator has no warp shuffles. Every thread
of the block must call a reduction (the barriers are block-wide), with a neutral value
where it has nothing to add.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import cuda

__all__ = ["block_reducers"]

SEGMENT = 32  # threads per segment (one warp), or the whole block if smaller


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

    W = min(SEGMENT, NT)

    @cuda.jit(device=True)
    def segment_sum(sh, v):
        """Sum of ``v`` over this thread's segment of W threads; every thread of the segment gets it."""
        t = cuda.threadIdx.x
        lane = t % W
        sh[t] = v
        cuda.syncthreads()
        s = W // 2
        while s > 0:
            if lane < s:
                sh[t] += sh[t + s]
            cuda.syncthreads()
            s //= 2
        total = sh[t - lane]
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def segment_max(sh, v):
        """Maximum of ``v`` over this thread's segment of W threads; every thread of the segment gets it."""
        t = cuda.threadIdx.x
        lane = t % W
        sh[t] = v
        cuda.syncthreads()
        s = W // 2
        while s > 0:
            if lane < s and sh[t + s] > sh[t]:
                sh[t] = sh[t + s]
            cuda.syncthreads()
            s //= 2
        best = sh[t - lane]
        cuda.syncthreads()
        return best

    return SimpleNamespace(block_sum=block_sum, block_max=block_max, segment_sum=segment_sum,
                           segment_max=segment_max, W=W)
