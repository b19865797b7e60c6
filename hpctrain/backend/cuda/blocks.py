"""What the CUDA kernel families share: the launch decorator, block-wide reductions, and the kernels that fill
a buffer and finish a reduction.

    kernel = kernel_decorator(nt)  # checks nt (a power of two, 2..1024), mends the simulator, launch bounds
    r = block_reducers(nt)        # nt: threads per block, a power of two
    total = r.block_sum(sh, v)    # sh: a cuda.shared.array(nt, ...) of the caller's, reusable at once after
    total = r.segment_sum(sh, v)  # over the thread's segment of r.W consecutive threads (r.W = min(32, nt))
    mx, j = r.row_argmax(sh_max, sh_arg, logits, row)  # a row's maximum and first column reaching it
    total = r.column_sum(sh, v)   # over threadIdx.y of an r.RX × r.RY block (the column sums' first pass)
    k = kernels(nt)               # fill, sum_partials (one block adds per-block float64 partials), column_finish

Every family module (linear.py, norm.py, loss.py, ...) builds its kernels in a ``kernels(nt)`` of its own,
cached: shared-array shapes must be compile-time constants, so the kernels are compiled per block size, lazily
(numba compiles at the first launch).

Column sums (bias and LayerNorm parameter gradients) take two passes: a grid of RX×RY blocks, RX threads on
neighbouring columns (coalesced reads) and RY threads over the rows of the block's row group, the RY sums combined
in shared memory into one float64 partial per (row group, column); then ``column_finish``, one thread per column,
adds its partials in order. No atomics, so results are deterministic run to run.

Segments are what a warp would reduce with shuffles; they go through shared memory and
block barriers instead, because numba's CUDA simulator has no warp shuffles. Every thread
of the block must call a reduction (the barriers are block-wide), with a neutral value
where it has nothing to add.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, float64, int64

from ...errors import BackendError
from . import sim

__all__ = ["block_reducers", "kernel_decorator", "kernels", "reduce_shape"]

SEGMENT = 32  # threads per segment (one warp), or the whole block if smaller


def kernel_decorator(nt: int):
    """``cuda.jit`` for the kernels of blocks of ``nt`` threads (sim.kernel_jit), once ``nt`` is checked; under
    the simulator, shared arrays that every thread of a block agrees on (sim.install)."""
    if nt < 2 or nt & (nt - 1) or nt > 1024:
        raise BackendError(f"CUDA block size {nt}: must be a power of two between 2 and 1024")
    sim.install()
    return sim.kernel_jit(nt)


def reduce_shape(nt: int) -> tuple[int, int]:
    """(RX, RY) of the column-sum block: a warp of columns on a GPU, a square-ish block when tiny."""
    rx = 32 if nt >= 64 else max(1, nt // 4)
    return rx, nt // rx


@functools.lru_cache(maxsize=None)
def block_reducers(nt: int) -> SimpleNamespace:
    W = min(SEGMENT, nt)
    RX, RY = reduce_shape(nt)
    return SimpleNamespace(block_sum=_tree(nt, False), block_max=_tree(nt, True), segment_sum=_tree(W, False),
                           segment_max=_tree(W, True), row_argmax=_row_argmax(nt), W=W,
                           column_sum=_column_sum(RY), RX=RX, RY=RY)


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """fill, sum_partials and column_finish for blocks of ``nt`` threads; compiled lazily, once per process."""
    NT, kernel = nt, kernel_decorator(nt)
    red = block_reducers(nt)
    block_sum = red.block_sum

    @kernel
    def fill(x, value):
        """x[n] = value (any dtype)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            x[i] = value

    @kernel
    def sum_partials(partial, out):
        """out[0] = Σ partial (one block)."""
        sh = cuda.shared.array(NT, float64)
        acc = float64(0.0)
        for i in range(cuda.threadIdx.x, partial.size, NT):
            acc += partial[i]
        total = block_sum(sh, acc)
        if cuda.threadIdx.x == 0:
            out[0] = total

    @kernel
    def column_finish(partial, out, accumulate):
        """Column sums, pass 2: out[C] (+)= Σ_g partial[g, C], added in g order in float64 and rounded once
        (deterministic: no atomics, the same order every run)."""
        G, C = partial.shape
        for col in range(cuda.grid(1), C, cuda.gridsize(1)):
            total = float64(0.0)
            for g in range(G):
                total += partial[g, col]
            if accumulate:
                total += float64(out[col])
            out[col] = float32(total)

    return SimpleNamespace(fill=fill, sum_partials=sum_partials, column_finish=column_finish, RX=red.RX, RY=red.RY)


@functools.lru_cache(maxsize=None)
def _column_sum(RY: int):
    """Sum of ``v`` over threadIdx.y of a RX×RY block (in ``sh``'s dtype, shaped (RY, RX)); valid in the
    ty == 0 threads."""

    @cuda.jit(device=True)
    def column_sum(sh, v):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        sh[ty, tx] = v
        cuda.syncthreads()
        s = RY // 2
        while s > 0:
            if ty < s:
                sh[ty, tx] += sh[ty + s, tx]
            cuda.syncthreads()
            s //= 2
        return sh[0, tx]

    return column_sum


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
