"""CUDA kernels of the transformer ops: token + position embedding, causal multi-head self-attention.

Shape letters: B batch, T sequence, C channels, V vocabulary, H heads of hs = C/H
channels; qkv[B·T, 3C] is the fused projection (q in columns 0..C-1, k in C..2C-1,
v in 2C..3C-1, head h in columns h·hs..(h+1)·hs-1 of each), att[B, H, T, T] the
softmax probabilities (0 above the diagonal). Forward and backward kernels sit
side by side; each matches cpu.py's numba kernel, see there for the formulas.
Launch shapes, ``NT`` threads per block (a power of two fixed at construction):

* embedding rows: one block per row, grid-stride over rows, the threads stride over
  the row;
* attention: q·kᵀ, att·v and the three products of the backward pass are batched
  GEMMs over (batch, head) that read q, k, v in place from qkv (cuda_gemm.py,
  ``CudaBackend.attention_forward/backward``); the causal softmax and its gradient
  are row kernels here, one segment of 32 threads (a warp's worth) per row of
  att[B·H·T, T], 8 rows per 256-thread block, combining through shared memory, the
  scale and the causal mask fused in.

No floating-point atomics, so every result is bit-identical run to run. The token
gradient is a scatter-add: the host sorts the ids (stable), and one block per
distinct id adds that id's rows in batch order, into float32 like cpu.py, so
``embedding_backward`` agrees with the CPU backend bit for bit. Arithmetic is
float32 like the arrays (float32 literals keep numba off the float64 units).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32

from ..errors import BackendError
from . import cuda_sim
from .cuda_blocks import block_reducers

__all__ = ["transformer_kernels"]

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_NEG_INF = np.float32(-np.inf)


@functools.lru_cache(maxsize=None)
def transformer_kernels(nt: int) -> SimpleNamespace:
    """The embedding and attention kernels for blocks of ``nt`` threads; compiled lazily, once per process."""
    if nt < 2 or nt & (nt - 1) or nt > 1024:
        raise BackendError(f"CUDA block size {nt}: must be a power of two between 2 and 1024")
    cuda_sim.install()  # under the simulator: shared arrays that every thread of a block agrees on
    NT = nt
    kernel = cuda_sim.kernel_jit(NT)  # every kernel here is launched with NT threads per block

    red = block_reducers(nt)
    segment_sum, segment_max = red.segment_sum, red.segment_max
    W = red.W  # threads per attention row
    R = NT // W  # attention rows per block

    # ------------------------------------------------------------------ embedding

    @kernel
    def embedding_forward(idx, wte, wpe, out, bad, lo, vocab, add_positions):
        """out[b·T + t] = wte[idx[b, t] − lo] + wpe[t] (a zero row for an id outside [lo, lo + V), no wpe without
        ``add_positions``); bad[0] = min(bad[0], first flat position of an id outside [0, vocab))."""
        B, T = idx.shape
        V, C = wte.shape
        for r in range(cuda.blockIdx.x, B * T, cuda.gridDim.x):
            t = r % T
            v = idx[r // T, t]
            if v < 0 or v >= vocab:
                if cuda.threadIdx.x == 0:
                    cuda.atomic.min(bad, 0, r)  # an integer min: the same answer in any order
            else:
                u = v - lo
                mine = u >= 0 and u < V
                for c in range(cuda.threadIdx.x, C, NT):
                    if mine:
                        out[r, c] = wte[u, c] + wpe[t, c] if add_positions else wte[u, c]
                    else:
                        out[r, c] = wpe[t, c] if add_positions else _ZERO

    @kernel
    def embedding_backward_wte(dout, order, starts, tokens, dwte):
        """dwte[tokens[u]] += Σ dout[order[p]] for p in starts[u]..starts[u+1]-1 (the rows of that id, in order)."""
        C = dwte.shape[1]
        for u in range(cuda.blockIdx.x, tokens.size, cuda.gridDim.x):
            v = tokens[u]
            lo = starts[u]
            hi = starts[u + 1]
            for c in range(cuda.threadIdx.x, C, NT):
                acc = dwte[v, c]
                for p in range(lo, hi):
                    acc += dout[order[p], c]
                dwte[v, c] = acc

    @kernel
    def embedding_backward_wpe(dout, B, T, dwpe, accumulate):
        """dwpe[t] (+)= Σ_b dout[b·T + t] for t < T, b in order; rows t ≥ T are zeroed unless accumulating."""
        C = dwpe.shape[1]
        for i in range(cuda.grid(1), dwpe.size, cuda.gridsize(1)):
            t = i // C
            c = i % C
            if t < T:
                acc = dwpe[t, c] if accumulate else _ZERO
                for b in range(B):
                    acc += dout[b * T + t, c]
                dwpe[t, c] = acc
            elif not accumulate:
                dwpe[t, c] = _ZERO

    # ------------------------------------------------------------------ causal attention: the row kernels
    # The products (q·kᵀ, att·v and their gradients) are batched GEMMs (cuda_gemm.py, CudaBackend.attention_*);
    # these kernels do what lies between them, one segment of W threads per row of att[B·H·T, T], R rows a block.

    @kernel
    def attention_softmax_rows(att, T, scale):
        """att[r, j] = softmax_{j ≤ i}(scale · att[r, j]) in place, 0 for j > i, where i = r % T."""
        sh = cuda.shared.array(NT, float32)
        tid = cuda.threadIdx.x
        lane = tid % W
        rows = att.shape[0]
        for r0 in range(cuda.blockIdx.x * R, rows, cuda.gridDim.x * R):  # the same r0 for the whole block
            r = r0 + tid // W
            i = r % T
            n = i + 1 if r < rows else 0  # a thread past the last row still takes part in the reductions
            mx = _NEG_INF
            for j in range(lane, n, W):
                mx = max(mx, att[r, j] * scale)
            mx = segment_max(sh, mx)
            z = _ZERO
            for j in range(lane, n, W):  # each thread reads back only the entries it wrote
                e = math.exp(att[r, j] * scale - mx)
                att[r, j] = e
                z += e
            z = segment_sum(sh, z)
            if r < rows:
                inv = _ONE / z
                for j in range(lane, T, W):
                    att[r, j] = att[r, j] * inv if j <= i else _ZERO

    @kernel
    def attention_softmax_backward_rows(att, dscores, T, scale):
        """dscores[r, j] = scale · att ⊙ (datt − Σ_j att·datt) in place, where dscores holds datt = dy·vᵀ on
        and below the diagonal; 0 for j > i."""
        sh = cuda.shared.array(NT, float32)
        tid = cuda.threadIdx.x
        lane = tid % W
        rows = att.shape[0]
        for r0 in range(cuda.blockIdx.x * R, rows, cuda.gridDim.x * R):
            r = r0 + tid // W
            i = r % T
            n = i + 1 if r < rows else 0
            dot = _ZERO
            for j in range(lane, n, W):
                dot += att[r, j] * dscores[r, j]
            dot = segment_sum(sh, dot)
            if r < rows:
                for j in range(lane, T, W):
                    dscores[r, j] = scale * att[r, j] * (dscores[r, j] - dot) if j <= i else _ZERO

    return SimpleNamespace(
        NT=NT, embedding_forward=embedding_forward, embedding_backward_wte=embedding_backward_wte,
        embedding_backward_wpe=embedding_backward_wpe, attention_softmax_rows=attention_softmax_rows,
        attention_softmax_backward_rows=attention_softmax_backward_rows, ROWS_PER_BLOCK=R)
