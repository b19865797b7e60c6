"""Block-wide reductions shared by the CUDA kernels: every thread of a 1-D block gets the result.

    r = block_reducers(nt)        # nt: threads per block, a power of two
    total = r.block_sum(sh, v)    # sh: a cuda.shared.array(nt, ...) of the caller's, reusable at once after
    total = r.segment_sum(sh, v)  # over the thread's segment of r.W consecutive threads (r.W = min(32, nt))
    mx, j = r.row_argmax(sh_max, sh_arg, logits, row)  # a row's maximum and first column reaching it

Segments are what a warp would reduce with shuffles; they go through shared memory and
block barriers instead, because numba's CUDA simulator has no warp shuffles. Every thread
of the block must call a reduction (the barriers are block-wide), with a neutral value
where it has nothing to add.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
from numba import cuda, int64

__all__ = ["block_reducers"]

SEGMENT = 32  # threads per segment (one warp), or the whole block if smaller


@functools.lru_cache(maxsize=None)
def block_reducers(nt: int) -> SimpleNamespace:
    W = min(SEGMENT, nt)
    return SimpleNamespace(block_sum=_tree(nt, False), block_max=_tree(nt, True), segment_sum=_tree(W, False),
                           segment_max=_tree(W, True), row_argmax=_row_argmax(nt), W=W)


@functools.lru_cache(maxsize=None)
def _tree(width: int, take_max: bool):
    """A shared-memory tree reduction (sum, or maximum with ``take_max``) over each run of ``width`` consecutive
    threads (the whole block when ``width`` is its size); every thread of the run gets the result and ``sh``
    may be reused at once."""

    @cuda.jit(device=True)
    def reduce(sh, v):
        t = cuda.threadIdx.x
        lane = t % width
        sh[t] = v
        cuda.syncthreads()
        s = width // 2
        while s > 0:
            if lane < s:
                if take_max:
                    if sh[t + s] > sh[t]:
                        sh[t] = sh[t + s]
                else:
                    sh[t] += sh[t + s]
            cuda.syncthreads()
            s //= 2
        result = sh[t - lane]
        cuda.syncthreads()  # so the caller may reuse ``sh`` at once
        return result

    return reduce


_NEG_INF = np.float32(-np.inf)


@functools.lru_cache(maxsize=None)
def _row_argmax(nt: int):
    """(maximum, first column reaching it) of row ``row`` of a 2-D float32 array, over a block of ``nt`` threads,
    ties broken as numpy's argmax (the lowest column); the number of columns for an empty row. ``sh_max`` (float32)
    and ``sh_arg`` (int64) are the caller's shared arrays of ``nt``, reusable at once after."""

    @cuda.jit(device=True)
    def row_argmax(sh_max, sh_arg, values, row):
        t = cuda.threadIdx.x
        C = values.shape[1]
        best = _NEG_INF
        best_j = int64(C)
        for j in range(t, C, nt):
            v = values[row, j]
            if v > best:
                best = v
                best_j = j
        sh_max[t] = best
        sh_arg[t] = best_j
        cuda.syncthreads()
        s = nt // 2
        while s > 0:
            if t < s:
                other = sh_max[t + s]
                if other > sh_max[t] or (other == sh_max[t] and sh_arg[t + s] < sh_arg[t]):
                    sh_max[t] = other
                    sh_arg[t] = sh_arg[t + s]
            cuda.syncthreads()
            s //= 2
        mx = sh_max[0]
        arg = sh_arg[0]
        cuda.syncthreads()  # so the caller may reuse the shared arrays at once
        return mx, arg

    return row_argmax
