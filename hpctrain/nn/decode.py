"""Generation with a key/value cache: a GPT's prompt run once, then one position a new token.

    dec = CachedDecoder(part, be)        # a bound, single-process GPT part (nn/gpt.py's units)
    z = dec.prefill(ids)                 # the last block_size ids: logits after the last, keys and values kept
    z = dec.step(next_id)                # one more position: its row through every unit, attention over the cache

``prefill`` runs the units' own forward over a full window (the ids left-aligned, as ``hpctrain sample
--no-cache`` does for every token) and keeps each block's keys and values of the positions that hold ids.
``step`` embeds one id at the next position and runs each block on that single row: ln_1, c_attn, the new
query's attention over the cached keys and values (the new key and value appended first), c_proj, the residual,
ln_2, the MLP, the residual; then the head. The cache holds at most block_size positions: a caller past it
slides the window by calling ``prefill`` with the last block_size ids (``full``).

Shape letters: T block_size, C n_embd, H heads, hs = C / H head size, n cached positions.

The one-query attention (``attend_one``) is a numpy composition on the host: the new row's q, k, v come to the
host (3C floats a block), the cache lives there as (H, T, hs) float32 per block, and the output row (C floats)
goes back to the backend. On a GPU that is two small copies a block and token; a backend kernel
``attention_decode(q[1, C], k_cache[H, T, hs], v_cache[H, T, hs], n, out[1, C])`` with the cache on the device
would replace it (docs/gpt.md).
"""

from __future__ import annotations

import math

import numpy as np

from .gpt import Block, Embedding, Head

__all__ = ["CachedDecoder", "attend_one"]


def attend_one(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q·kᵀ/√hs)·v of one query a head: q (H, hs), k and v (H, n, hs) -> (H, hs), float32 (the
    probabilities of all n cached positions: the causal mask lets the newest position see every earlier one)."""
    hs = q.shape[-1]
    scores = np.einsum("hd,hnd->hn", q, k) * np.float32(1.0 / math.sqrt(hs))
    scores -= scores.max(axis=1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hn,hnd->hd", p, v).astype(np.float32, copy=False)


class CachedDecoder:
    """A GPT part's units (embedding, blocks, head; no dropout, no tensor parallelism) with a key/value cache."""

    def __init__(self, part, be):
        self.be, self.layers = be, list(part.layers)
        if not (isinstance(self.layers[0], Embedding) and isinstance(self.layers[-1], Head)
                and all(isinstance(b, Block) for b in self.layers[1:-1])):
            raise ValueError("CachedDecoder needs a whole, single-process GPT part (embedding, blocks, head)")
        self.blocks = self.layers[1:-1]
        first = self.blocks[0] if self.blocks else None
        self.T = self.layers[0].params[1][1][0]  # wpe's rows: block_size
        self.C = self.layers[0].out_features
        self.H = first.attn.n_head if first is not None else 1
        self.hs = self.C // self.H
        self.k = np.zeros((len(self.blocks), self.H, self.T, self.hs), dtype=np.float32)
        self.v = np.zeros_like(self.k)
        self.n = 0  # positions cached

    @property
    def full(self) -> bool:
        """No room for another position: the next token needs ``prefill`` of the slid window."""
        return self.n >= self.T

    def prefill(self, ids) -> np.ndarray:
        """Logits (float64) after the last of ``ids`` (its last block_size ids, left-aligned in a full window); the
        cache then holds those positions' keys and values."""
        be, T, C = self.be, self.T, self.C
        context = np.asarray(ids, dtype=np.int64)[-T:]
        n = len(context)
        window = np.zeros((1, T), dtype=np.int64)
        window[0, :n] = context
        x, _ = self.layers[0].forward(be, be.asarray(window))
        for i, block in enumerate(self.blocks):
            x, saved = block.forward(be, x)
            qkv = be.to_host(saved[2][0])[:n]  # the attention's saved (qkv, ...): rows of the positions with ids
            self.k[i, :, :n] = qkv[:, C : 2 * C].reshape(n, self.H, self.hs).transpose(1, 0, 2)
            self.v[i, :, :n] = qkv[:, 2 * C :].reshape(n, self.H, self.hs).transpose(1, 0, 2)
        logits, _ = self.layers[-1].forward(be, x)
        self.n = n
        return be.to_host(logits)[n - 1].astype(np.float64)

    def step(self, token: int) -> np.ndarray:
        """Logits (float64) after one more id, at position ``n`` (the cache must not be ``full``)."""
        if self.full:
            raise ValueError(f"the cache holds block_size = {self.T} positions: prefill the slid window")
        be, p, C, H, hs = self.be, self.n, self.C, self.H, self.hs
        emb = self.layers[0]
        x = be.empty((1, C))
        be.embedding_forward(be.asarray(np.array([[token]], dtype=np.int64)), emb.w["wte.weight"],
                             emb.w["wpe.weight"][p : p + 1], x)
        for i, block in enumerate(self.blocks):
            h, _ = block.ln_1.forward(be, x)
            qkv, _ = block.c_attn.forward(be, h)
            row = be.to_host(qkv)[0]
            self.k[i, :, p] = row[C : 2 * C].reshape(H, hs)
            self.v[i, :, p] = row[2 * C :].reshape(H, hs)
            a = attend_one(row[:C].reshape(H, hs), self.k[i, :, : p + 1], self.v[i, :, : p + 1])
            x2, _ = block.attn_proj.forward(be, be.asarray(a.reshape(1, C)))
            h2, _ = block.ln_2.forward_residual(be, x2, x)  # the first residual, fused with ln_2 as in Block
            f, _ = block.c_fc.forward(be, h2)
            g, _ = block.gelu.forward(be, f)
            out, _ = block.mlp_proj.forward(be, g)
            be.add_(out, x2)  # the second residual
            x = out
        logits, _ = self.layers[-1].forward(be, x)
        self.n = p + 1
        return be.to_host(logits)[0].astype(np.float64)
