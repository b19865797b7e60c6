"""Token and position embedding on the GPU, forward and backward.

Shape letters: B batch, T sequence, C channels, V vocabulary (a shard's block: ids [lo, lo + V)). The forward is
a row kernel (one block per row of out[B·T, C]); the token gradient a scatter-add with no atomics: the host sorts
the ids (stable), and one block per distinct id adds that id's rows in batch order, into float32 as the CPU
backend's (cpu/embedding.py), so the two agree bit for bit.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
from numba import cuda

from . import blocks
from .memory import is_device_array

__all__ = ["kernels", "Embedding"]

_ZERO = np.float32(0.0)


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """The embedding kernels for blocks of ``nt`` threads; compiled lazily, once per process."""
    NT, kernel = nt, blocks.kernel_decorator(nt)

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
    def embedding_backward_wte(dout, plan, n, dwte):
        """dwte[tokens[u]] += Σ dout[order[p]] for p in starts[u]..starts[u+1]-1 (the rows of that id, in order),
        for the plan's U = plan[0] distinct ids: plan = [U, order (n), starts (n + 1), tokens (n)], n the batch's
        rows. Its shape and the launch are the same whatever the batch's ids (issue 49: one graph a step)."""
        C = dwte.shape[1]
        starts, tokens = 1 + n, 2 + 2 * n
        for u in range(cuda.blockIdx.x, plan[0], cuda.gridDim.x):
            v = plan[tokens + u]
            lo = plan[starts + u]
            hi = plan[starts + u + 1]
            for c in range(cuda.threadIdx.x, C, NT):
                acc = dwte[v, c]
                for p in range(lo, hi):
                    acc += dout[plan[1 + p], c]
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

    return SimpleNamespace(embedding_forward=embedding_forward, embedding_backward_wte=embedding_backward_wte,
                           embedding_backward_wpe=embedding_backward_wpe)


class Embedding:
    """CudaBackend's embedding (a mixin)."""

    def embedding_forward(self, idx, wte, wpe, out, *, vocab_start=0, vocab=None, add_positions=True):
        """out[B·T, C] = wte[idx[b, t]] + wpe[t] for token ids idx[B, T] (int64), wte[V, C], wpe[≥T, C]; a
        vocab-parallel shard as the CPU backend's. An id outside [0, vocab) raises BackendError: host ids are checked
        on the host and uploaded (no wait); for device ids the kernel leaves the first such position in one int64
        that is read back (a wait)."""
        op = "embedding_forward"
        B, T, V, C, lo, vocab = self._embedding_args(op, idx, wte, wpe, out, "out", vocab_start, vocab)
        n = B * T
        if n == 0:
            return
        on_host = not is_device_array(idx)
        if on_host:
            self._check_ids_on_host(op, idx, vocab)
            idx = self.upload(idx)
        self.fill_(self._bad_token, n)
        self._launch(self._k.embedding_forward, self._rows_grid(n), self.block, idx, wte, wpe, out, self._bad_token,
                     lo, vocab, bool(add_positions))
        if on_host:
            return
        self._host_acts()
        self._bad_token.copy_to_host(self._host_bad_token, stream=self.stream)
        self._wait()
        bad = int(self._host_bad_token[0])
        if bad < n:
            self.bad_token(idx, bad, vocab)

    def embedding_backward(self, dout, idx, dwte, dwpe, *, vocab_start=0, vocab=None, accumulate_wte=False,
                           accumulate_wpe=False):
        """dwte[v − vocab_start] (+)= Σ dout rows with id v (ids of dwte's block); dwpe[t] (+)= Σ_b dout[b·T + t]
        (rows ≥ T of dwpe: 0 or kept). Deterministic, and bit-identical to the CPU backend: the ids are sorted on
        the host (device ids are read back first: a wait), then one block per distinct id adds its rows in batch
        order; no atomics."""
        op = "embedding_backward"
        B, T, V, C, lo, vocab = self._embedding_args(op, idx, dwte, dwpe, dout, "dout", vocab_start, vocab)
        ids = self.to_host(idx).reshape(-1) if B * T and C else None  # first: the wpe kernel overlaps the sort
        if not accumulate_wte:
            self.fill_(dwte, 0)
        self._elementwise(self._k.embedding_backward_wpe, dwpe.size, dout, B, T, dwpe, bool(accumulate_wpe))
        if ids is None:
            return
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            self.bad_token(idx, int(bad[0]), vocab, op=op)
        order = np.argsort(ids, kind="stable")  # stable: each id's rows stay in batch order
        ids = ids[order] - lo
        keep = (ids >= 0) & (ids < V)  # this table's block of the vocabulary
        order, ids = order[keep], ids[keep]
        n, rows = ids.size, B * T
        starts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        starts = np.concatenate(([0], starts, [n])) if n else np.zeros(1, dtype=np.int64)
        tokens = ids[starts[:-1]]
        U = tokens.size
        # one upload of one shape per batch shape, each part at a fixed place (the kernel reads U from it): the
        # launch is the same for any ids, none of this table's block included
        plan = np.zeros(3 * rows + 2, dtype=np.int64)
        plan[0] = U
        plan[1 : 1 + n] = order
        plan[1 + rows : 2 + rows + U] = starts
        plan[2 + 2 * rows : 2 + 2 * rows + U] = tokens
        self._launch(self._k.embedding_backward_wte, self._rows_grid(rows), self.block, dout, self.upload(plan), rows,
                     dwte)
