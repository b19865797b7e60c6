"""What the CUDA kernel families share: the launch decorator, block-wide reductions, and the kernels that fill
a buffer and finish a reduction.

    kernel = kernel_decorator(nt)  # checks nt (a power of two, 2..1024), mends the simulator, launch bounds
    r = block_reducers(nt)        # nt: threads per block, a power of two
    total = r.block_sum(sh, v)    # sh: a cuda.shared.array(nt, ...) of the caller's, reusable at once after
    total = r.segment_sum(sh, v)  # over the thread's segment of r.W consecutive threads (r.W = min(32, nt))
    mx, j = r.row_argmax(sh_max, sh_arg, logits, row)  # a row's maximum and first column reaching it
    mx, j = r.argmax_combine(sh_max, sh_arg, best, best_j)  # the block's (maximum, first column) of per-thread ones
    total = r.column_sum(sh, v)   # over threadIdx.y of an r.RX × r.RY block (the column sums' first pass)
    r.finish_columns(sh, partial, G, out, accumulate)  # the column sums' second pass, by the last block
    last = last_to_finish(sh_flag, counters, slot, blocks)  # True in the last of ``blocks`` blocks to get here
    k = kernels(nt)               # fill, sum_partials (one block adds per-block float64 partials)

Every family module (linear.py, norm.py, loss.py, ...) builds its kernels in a ``kernels(nt)`` of its own,
cached: shared-array shapes must be compile-time constants, so the kernels are compiled per block size, lazily
(numba compiles at the first launch).

Column sums (the bias gradient) take one launch of two passes: a grid of RX×RY blocks, RX threads on neighbouring
columns (coalesced reads) and RY threads over the rows of the block's row group, the RY sums combined in shared
memory into one float64 partial per (row group, column); then the last block of each column block to finish
(``last_to_finish``) adds that column block's partials (``finish_columns``). Which block is last varies from run to
run, what it adds and in which order does not: the only atomic is the counter that tells a block it is the last, so
results are deterministic run to run (llm.c's layernorm_backward does the same). LayerNorm's parameter gradients
(norm.py) and the cross-entropy's totals (loss.py) finish the same way, each in its row kernel's launch.

``last_to_finish`` counts into ``counters`` (int64, zero between launches: the last block sets its slot back to
0), which CudaBackend keeps (``_counter_slots``); kernels that use them run one at a time on the backend's stream.
Their partials are laid out so that no cache line holds two blocks' (``CudaBackend._partials``, the column sums'
[column block, row group, RX padded]): numba has no volatile loads, and an SM's L1 could otherwise hold a line of
another block's partials from before that block wrote them.

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
from ..dropout_mask import GOLDEN, MUL1, MUL2
from . import sim

__all__ = ["block_reducers", "kernel_decorator", "kernels", "last_to_finish", "reduce_shape", "ZERO", "ONE", "NEG_INF"]

# float32 constants for the kernels (a Python float would make numba compute in float64)
ZERO, ONE, NEG_INF = np.float32(0.0), np.float32(1.0), np.float32(-np.inf)

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
    column_sum = _column_sum(RY)
    return SimpleNamespace(block_sum=_tree(nt, False), block_max=_tree(nt, True), segment_sum=_tree(W, False),
                           segment_max=_tree(W, True), row_argmax=_row_argmax(nt), argmax_combine=_argmax_combine(nt),
                           W=W, column_sum=column_sum, finish_columns=_finish_columns(RX, RY, column_sum), RX=RX, RY=RY)


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """fill and sum_partials for blocks of ``nt`` threads; compiled lazily, once per process."""
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

    return SimpleNamespace(fill=fill, sum_partials=sum_partials, RX=red.RX, RY=red.RY)


_GOLDEN, _MUL1, _MUL2 = np.uint64(GOLDEN), np.uint64(MUL1), np.uint64(MUL2)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


@cuda.jit(device=True)
def mix64(z):
    """splitmix64's output function on a uint64 (dropout_mask.py's ``mix64``)."""
    z = z + _GOLDEN
    z = (z ^ (z >> _S30)) * _MUL1
    z = (z ^ (z >> _S27)) * _MUL2
    return z ^ (z >> _S31)


@cuda.jit(device=True)
def site_key(seed_mix, step, site):
    """dropout_mask.py's site_key(seed, step, site), given ``seed_mix`` = mix64(seed): the dropout kernels derive
    their key from the step read in device memory, so their launch is the same every step."""
    return mix64(mix64(seed_mix ^ step) ^ site)


@cuda.jit(device=True)
def last_to_finish(sh_flag, counters, slot, blocks):
    """True in every thread of the block that is the last of ``blocks`` blocks to call this on counters[slot]
    (False in the others), once each block's results are written: a fence makes them visible to the last block
    before it counts. The last block sets the counter back to 0 for the next launch. ``sh_flag``: the caller's
    shared int64 array of 1. Every thread of the block must call it."""
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and cuda.threadIdx.y == 0:
        last = cuda.atomic.add(counters, slot, 1) == blocks - 1
        if last:
            counters[slot] = 0  # every block has counted: none reads it again in this launch
        sh_flag[0] = 1 if last else 0
    cuda.syncthreads()
    return sh_flag[0] == 1


@functools.lru_cache(maxsize=None)
def _finish_columns(RX: int, RY: int, column_sum):
    """The column sums' second pass in the last block of column block bx (RX×RY threads): out[col] (+)=
    Σ_{g < G} partial[bx, g, tx] over its RX columns (col = bx·RX + tx), thread row ty adding g = ty, ty + RY, ...
    and the RY sums combined by ``column_sum`` (``sh``: a float64 (RY, RX) shared array), rounded to float32 once."""

    @cuda.jit(device=True)
    def finish_columns(sh, partial, G, out, accumulate):
        C = out.shape[0]
        bx = cuda.blockIdx.x
        tx = cuda.threadIdx.x
        col = bx * RX + tx
        acc = float64(0.0)
        if col < C:
            for g in range(cuda.threadIdx.y, G, RY):
                acc += partial[bx, g, tx]
        total = column_sum(sh, acc)
        if cuda.threadIdx.y == 0 and col < C:
            if accumulate:
                total += float64(out[col])
            out[col] = float32(total)

    return finish_columns


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


_NEG_INF = NEG_INF


@functools.lru_cache(maxsize=None)
def _argmax_combine(nt: int):
    """(maximum, first column reaching it) over a block of ``nt`` threads, each holding its own (``best``,
    ``best_j``: its first column reaching ``best``), ties broken as numpy's argmax (the lowest column). ``sh_max``
    (float32) and ``sh_arg`` (int64) are the caller's shared arrays of ``nt``, reusable at once after."""

    @cuda.jit(device=True)
    def argmax_combine(sh_max, sh_arg, best, best_j):
        t = cuda.threadIdx.x
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

    return argmax_combine


@functools.lru_cache(maxsize=None)
def _row_argmax(nt: int):
    """(maximum, first column reaching it) of row ``row`` of a 2-D float32 array, over a block of ``nt`` threads,
    ties broken as numpy's argmax (the lowest column); the number of columns for an empty row. ``sh_max`` (float32)
    and ``sh_arg`` (int64) are the caller's shared arrays of ``nt``, reusable at once after."""
    combine = _argmax_combine(nt)

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
        return combine(sh_max, sh_arg, best, best_j)

    return row_argmax
