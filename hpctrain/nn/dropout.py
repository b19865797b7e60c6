"""Which dropout mask a training forward pass draws: ``DropoutKey``, one per micro-batch of a step.

nanoGPT's three dropouts (``model.dropout``): on the token + position embedding, on attention's probabilities,
and on each residual branch (attention's c_proj output, the MLP's c_proj output). A mask is a pure function of
(train.seed, global step, site, element) (backend/dropout_mask.py), where an element is named by its sample's
place in the step's *global* batch, its position, channel and, for attention, its head in the whole model. So
every layout draws the same masks as one process (data parallel, micro-batches, pipeline stages, tensor-parallel
heads), a recomputed forward draws the same as the first, the backward pass redraws the mask rather than
keeping it, and the CPU and CUDA backends agree bit for bit. Evaluation, sampling and prediction pass no key:
no dropout.

Sites: layer ``i`` of the model spec owns sites 4·i .. 4·i + 3 (the embedding 0; a block: + 0 attention, + 1
its residual branch, + 2 the MLP's).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backend.dropout_mask import DropRows, site_key

__all__ = ["DropoutKey", "SITES_PER_LAYER"]

SITES_PER_LAYER = 4


@dataclass(frozen=True)
class DropoutKey:
    """A micro-batch's dropout draw: the run's seed, the global step, and the place in the step's global batch
    of the micro-batch's first sample (its samples follow in order)."""

    seed: int
    step: int
    sample0: int

    def rows(self, p: float, site: int, positions: int) -> DropRows:
        """The draw over a (B·T, C) activation of this micro-batch: T = ``positions`` rows per sample."""
        return DropRows(p, site_key(self.seed, self.step, site), self.sample0 * positions, seed=self.seed,
                        step=self.step, site=site)

    def attention(self, p: float, site: int, T: int, head0: int, heads: int, n_head: int) -> DropRows:
        """The draw over attention's probabilities [B, heads, T, T] (rows (b·heads + h)·T + i) of heads
        [head0, head0 + heads) of the model's ``n_head``."""
        return DropRows(p, site_key(self.seed, self.step, site), (self.sample0 * n_head + head0) * T, heads * T,
                        n_head * T, causal=True, seed=self.seed, step=self.step, site=site)
