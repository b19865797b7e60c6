"""Token and position embedding on the CPU, forward and backward (``numba.njit``). Shape letters: B batch, T
positions, C width, V vocabulary (a shard's block of ids). The backward is one sequential pass in token order:
deterministic, and bit-identical to the CUDA backend's.
"""

from __future__ import annotations

from .jit import jit

__all__ = ["Embedding"]


@jit
def _embedding_forward(idx, wte, wpe, out, lo, vocab, add_positions):
    """out[b·T + t] = wte[idx[b, t] − lo] + wpe[t]; returns the flat position of the first id outside [0, vocab),
    or -1. An id outside the table's block [lo, lo + V) (a vocab-parallel shard) takes a zero row; without
    ``add_positions`` no wpe row is added (another tensor-parallel rank adds it)."""
    B, T = idx.shape
    V, C = wte.shape
    for b in range(B):
        for t in range(T):
            v = idx[b, t]
            if v < 0 or v >= vocab:
                return b * T + t
            r = b * T + t
            u = v - lo
            if 0 <= u < V:
                for c in range(C):
                    out[r, c] = wte[u, c] + wpe[t, c] if add_positions else wte[u, c]
            else:
                for c in range(C):
                    out[r, c] = wpe[t, c] if add_positions else 0.0
    return -1


@jit
def _embedding_backward(dout, idx, dwte, dwpe, lo, vocab, accumulate_wte, accumulate_wpe):
    """Scatter-add of dout's rows into dwte by token id (the ids of its block [lo, lo + V) only), summed over
    the batch into dwpe; one fixed order."""
    B, T = idx.shape
    V, C = dwte.shape
    for b in range(B):
        for t in range(T):
            if idx[b, t] < 0 or idx[b, t] >= vocab:
                return b * T + t
    if not accumulate_wte:
        dwte[:] = 0.0
    if not accumulate_wpe:
        dwpe[:] = 0.0
    for b in range(B):
        for t in range(T):
            u = idx[b, t] - lo
            r = b * T + t
            if 0 <= u < V:
                for c in range(C):
                    dwte[u, c] += dout[r, c]
            for c in range(C):
                dwpe[t, c] += dout[r, c]
    return -1


class Embedding:
    """CpuBackend's embedding (a mixin)."""

    def embedding_forward(self, idx, wte, wpe, out, *, vocab_start=0, vocab=None, add_positions=True):
        """out[B·T, C] = wte[idx[b, t]] + wpe[t] for token ids idx[B, T] (int64), wte[V, C], wpe[≥T, C].
        A vocab-parallel shard: wte holds ids [vocab_start, vocab_start + V) of ``vocab``, other ids take a
        zero row; ``add_positions = False`` leaves wpe out (base.py: ``_embedding_args``)."""
        B, T, V, C, lo, vocab = self._embedding_args("embedding_forward", idx, wte, wpe, out, "out",
                                                     vocab_start, vocab)
        bad = _embedding_forward(idx, wte, wpe, out, lo, vocab, bool(add_positions))
        if bad >= 0:
            self.bad_token(idx, bad, vocab, op="embedding_forward")

    def embedding_backward(self, dout, idx, dwte, dwpe, *, vocab_start=0, vocab=None, accumulate_wte=False,
                           accumulate_wpe=False):
        """dwte[v − vocab_start] (+)= Σ dout rows with id v (ids of dwte's block); dwpe[t] (+)= Σ_b dout[b·T + t]
        (rows ≥ T of dwpe: 0 or kept)."""
        B, T, V, C, lo, vocab = self._embedding_args("embedding_backward", idx, dwte, dwpe, dout, "dout",
                                                     vocab_start, vocab)
        bad = _embedding_backward(dout, idx, dwte, dwpe, lo, vocab, bool(accumulate_wte), bool(accumulate_wpe))
        if bad >= 0:
            self.bad_token(idx, bad, vocab, op="embedding_backward")
