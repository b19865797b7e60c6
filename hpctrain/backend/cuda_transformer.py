"""CUDA kernels of the transformer ops: token + position embedding, causal multi-head self-attention.

Shape letters: B batch, T sequence, C channels, V vocabulary, H heads of hs = C/H
channels; qkv[B·T, 3C] is the fused projection (q in columns 0..C-1, k in C..2C-1,
v in 2C..3C-1, head h in columns h·hs..(h+1)·hs-1 of each), att[B, H, T, T] the
softmax probabilities (0 above the diagonal). Forward and backward kernels sit
side by side; each matches cpu.py's numba kernel, see there for the formulas.
Launch shapes, ``NT`` threads per block (a power of two fixed at construction):

* row kernels (an embedding row, a softmax row): one block per row, grid-stride
  over rows, the threads stride over the row and combine with a shared-memory
  tree (the scores of a softmax row are dot products of length hs, one per thread);
* element kernels (att·v and the three parts of dqkv): grid-stride over the output,
  one thread per element computing its dot product over the causal range.

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
    block_sum, block_max = red.block_sum, red.block_max

    # ------------------------------------------------------------------ embedding

    @kernel
    def embedding_forward(idx, wte, wpe, out, bad):
        """out[b·T + t] = wte[idx[b, t]] + wpe[t]; bad[0] = min(bad[0], first flat position of an id outside wte)."""
        B, T = idx.shape
        V, C = wte.shape
        for r in range(cuda.blockIdx.x, B * T, cuda.gridDim.x):
            t = r % T
            v = idx[r // T, t]
            if v < 0 or v >= V:
                if cuda.threadIdx.x == 0:
                    cuda.atomic.min(bad, 0, r)  # an integer min: the same answer in any order
            else:
                for c in range(cuda.threadIdx.x, C, NT):
                    out[r, c] = wte[v, c] + wpe[t, c]

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

    # ------------------------------------------------------------------ causal attention

    @kernel
    def attention_softmax(qkv, T, H, scale, att):
        """att[b, h, i, j] = softmax_{j ≤ i}(scale · q_i·k_j), 0 for j > i: one block per row (b, h, i)."""
        sh = cuda.shared.array(NT, float32)
        C = qkv.shape[1] // 3
        hs = C // H
        B = qkv.shape[0] // T
        tid = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B * H * T, cuda.gridDim.x):
            i = row % T
            h = (row // T) % H
            b = row // (T * H)
            qi = b * T + i
            qc = h * hs
            kc = C + h * hs
            mx = _NEG_INF
            for j in range(tid, i + 1, NT):
                kj = b * T + j
                s = _ZERO
                for d in range(hs):
                    s += qkv[qi, qc + d] * qkv[kj, kc + d]
                s *= scale
                att[b, h, i, j] = s
                mx = max(mx, s)
            mx = block_max(sh, mx)
            z = _ZERO
            for j in range(tid, i + 1, NT):  # each thread reads back only the scores it wrote
                e = math.exp(att[b, h, i, j] - mx)
                att[b, h, i, j] = e
                z += e
            inv = _ONE / block_sum(sh, z)
            for j in range(tid, T, NT):
                att[b, h, i, j] = att[b, h, i, j] * inv if j <= i else _ZERO

    @kernel
    def attention_values(att, qkv, T, H, out):
        """out[b·T + i, h·hs + d] = Σ_{j ≤ i} att[b, h, i, j] · v[b·T + j, h·hs + d]: one thread per output."""
        C = out.shape[1]
        hs = C // H
        for n in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            r = n // C
            col = n % C
            b = r // T
            i = r % T
            h = col // hs
            vc = 2 * C + col
            acc = _ZERO
            for j in range(i + 1):
                acc += att[b, h, i, j] * qkv[b * T + j, vc]
            out[r, col] = acc

    @kernel
    def attention_softmax_backward(dout, qkv, att, T, H, scale, dscores):
        """dscores[b, h, i] = scale · att ⊙ (datt − Σ_j att·datt) with datt[j] = dy_i·v_j (0 for j > i):
        one block per row (b, h, i)."""
        sh = cuda.shared.array(NT, float32)
        C = dout.shape[1]
        hs = C // H
        B = dout.shape[0] // T
        tid = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B * H * T, cuda.gridDim.x):
            i = row % T
            h = (row // T) % H
            b = row // (T * H)
            yi = b * T + i
            yc = h * hs
            vc = 2 * C + h * hs
            dot = _ZERO
            for j in range(tid, i + 1, NT):
                vj = b * T + j
                s = _ZERO
                for d in range(hs):
                    s += dout[yi, yc + d] * qkv[vj, vc + d]
                dscores[b, h, i, j] = s  # datt for now; each thread reads back only its own
                dot += att[b, h, i, j] * s
            dot = block_sum(sh, dot)
            for j in range(tid, T, NT):
                if j <= i:
                    dscores[b, h, i, j] = scale * att[b, h, i, j] * (dscores[b, h, i, j] - dot)
                else:
                    dscores[b, h, i, j] = _ZERO

    @kernel
    def attention_backward_qkv(dout, qkv, att, dscores, T, H, dqkv):
        """dqkv[B·T, 3C], one thread per element: dq = dscores·k, dk = dscoresᵀ·q, dv = attᵀ·dy, per head."""
        C = dout.shape[1]
        hs = C // H
        width = 3 * C
        for n in range(cuda.grid(1), dqkv.size, cuda.gridsize(1)):
            r = n // width
            col = n % width
            part = col // C  # 0: q, 1: k, 2: v
            hc = col % C  # column within the part: h·hs + d
            h = hc // hs
            b = r // T
            t = r % T
            acc = _ZERO
            if part == 0:  # dq[t] = Σ_{j ≤ t} dscores[t, j] · k[j]
                for j in range(t + 1):
                    acc += dscores[b, h, t, j] * qkv[b * T + j, C + hc]
            elif part == 1:  # dk[t] = Σ_{i ≥ t} dscores[i, t] · q[i]
                for i in range(t, T):
                    acc += dscores[b, h, i, t] * qkv[b * T + i, hc]
            else:  # dv[t] = Σ_{i ≥ t} att[i, t] · dy[i]
                for i in range(t, T):
                    acc += att[b, h, i, t] * dout[b * T + i, hc]
            dqkv[r, col] = acc

    return SimpleNamespace(
        NT=NT, embedding_forward=embedding_forward, embedding_backward_wte=embedding_backward_wte,
        embedding_backward_wpe=embedding_backward_wpe, attention_softmax=attention_softmax,
        attention_values=attention_values, attention_softmax_backward=attention_softmax_backward,
        attention_backward_qkv=attention_backward_qkv)
