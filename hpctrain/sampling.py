"""The sampler: which samples every step uses, a pure function of the step, so resuming needs only the step number.

* ``shuffle = false``: step s uses training rows s·B … s·B+B−1 (B = global
  batch); an epoch is floor(N_train / B) steps, then the order wraps.
* ``shuffle = true``: epoch e uses ``numpy.random.default_rng([seed, e]).permutation(N_train)``.
* ``data.sampling = "random"`` (``RandomSampler``): nanoGPT's ``get_batch``, windows drawn by seed and step.

A run resumed with another batch size (``checkpoint.allow_changed``) goes on from the samples the
checkpoint's run had consumed in its epoch, rounded up to a whole batch of the new size (``continue_order``):
the sampler's ``offset`` shifts the step it maps, so step s reads what step s − offset would from the start.

Rank r of a data-parallel group of size dp takes the r-th contiguous slice of
B/dp rows of every global batch (the datasets of hpctrain/data.py read only those rows).
"""

from __future__ import annotations

import numpy as np

from .errors import DataError

__all__ = ["Sampler", "RandomSampler", "continue_order", "make_sampler"]


class Sampler:
    """Which rows of the training split global step ``s`` uses, and this rank's share of them.

    A shuffled epoch's order is drawn whole (the documented permutation) but a rank keeps only its own positions
    of it: steps_per_epoch × its share, int32 where the split allows, 1/dp of the order (``order_bytes``)."""

    def __init__(self, n_train: int, batch_size: int, *, shuffle: bool, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if batch_size > n_train:
            raise DataError(f"train.batch_size = {batch_size} is larger than the training split ({n_train} samples)")
        if batch_size % dp_size:
            raise DataError(f"train.batch_size = {batch_size} is not divisible by the data-parallel size {dp_size}")
        self.n_train, self.batch_size, self.shuffle, self.seed = n_train, batch_size, shuffle, seed
        self.steps_per_epoch = n_train // batch_size
        self.local = batch_size // dp_size
        self.dp_rank = dp_rank
        self.offset = 0  # step s maps to order position s - offset (continue_order: a resume with another batch)
        self._mine_epoch, self._mine = -1, None  # this rank's rows of each step of one shuffled epoch

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, steps into it) of global step ``step``."""
        return divmod(step - self.offset, self.steps_per_epoch)

    def epoch_of(self, step: int) -> int:
        return self.position(step)[0]

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_train)

    def global_rows(self, step: int) -> np.ndarray:
        """Every rank's rows of ``step`` (draws the epoch's order afresh: for checks and tools, not the loop)."""
        epoch, k = self.position(step)
        lo = k * self.batch_size
        if not self.shuffle:
            return np.arange(lo, lo + self.batch_size, dtype=np.int64)
        return self._permutation(epoch)[lo : lo + self.batch_size]

    def local_rows(self, step: int) -> np.ndarray:
        epoch, k = self.position(step)
        lo = self.dp_rank * self.local
        if not self.shuffle:
            first = k * self.batch_size + lo
            return np.arange(first, first + self.local, dtype=np.int64)
        if epoch != self._mine_epoch:
            self._mine = None  # the last epoch's positions go before the next order is drawn
            B, steps = self.batch_size, self.steps_per_epoch
            order = self._permutation(epoch)[: steps * B].reshape(steps, B)[:, lo : lo + self.local]
            self._mine = order.astype(np.int32 if self.n_train < 2**31 else np.int64)
            self._mine_epoch = epoch
        return self._mine[k].astype(np.int64)

    @property
    def order_bytes(self) -> int:
        """Bytes of the shuffled order this rank keeps between steps."""
        return 0 if self._mine is None else int(self._mine.nbytes)

    def reader(self, data):
        """What reads the samples ``local_rows`` names: the dataset itself (rows or windows by index)."""
        return data


class RandomSampler(Sampler):
    """``data.sampling = "random"``, nanoGPT's ``get_batch``: step ``s`` trains on the B windows of T + 1 tokens
    that begin at ``numpy.random.default_rng([seed, s]).integers(0, n_starts, B)`` (token positions of the
    training split, drawn with replacement), rank r taking the r-th slice of B/dp of them. A pure function of the
    seed and the step: every layout (dp, pp, tp, micro-batches) trains on the same windows, and a resumed run
    continues the stream where it stopped (with another batch size too: the stream is by step)."""

    def __init__(self, n_starts: int, batch_size: int, *, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if n_starts < 1:
            raise DataError("data.sampling = \"random\": the training split holds no whole window of "
                            "model.block_size + 1 tokens")
        if batch_size % dp_size:
            raise DataError(f"train.batch_size = {batch_size} is not divisible by the data-parallel size {dp_size}")
        # an "epoch" (checkpoints record it): as many windows as the starts would cut without overlap
        super().__init__(max(n_starts, batch_size), batch_size, shuffle=False, seed=seed, dp_rank=dp_rank,
                         dp_size=dp_size)
        self.n_starts = n_starts

    def global_rows(self, step: int) -> np.ndarray:
        return np.random.default_rng([self.seed, step]).integers(0, self.n_starts, self.batch_size, dtype=np.int64)

    def local_rows(self, step: int) -> np.ndarray:
        lo = self.dp_rank * self.local
        return self.global_rows(step)[lo : lo + self.local]

    def reader(self, data):
        return _AtOffsets(data)


class _AtOffsets:
    """A token dataset read by window start (``read_at``) where a batch names rows: the random sampler's reader."""

    def __init__(self, data):
        self.data = data

    def read(self, starts):
        return self.data.read_at(starts)


def continue_order(step: int, epoch: int, position: int, then_batch: int, batch: int,
                   steps_per_epoch: int) -> tuple[int, int]:
    """``(offset, skipped)`` for a run resumed at ``step`` from a checkpoint at (``epoch``, ``position`` steps
    of ``then_batch`` samples into it), now with ``batch`` samples a step and ``steps_per_epoch`` steps an
    epoch: it goes on from the first whole batch at or after the samples consumed (``skipped`` of them left
    out, fewer than one batch), or with the next epoch when none is left in this one. With the batch size and
    the data unchanged the offset is 0: the order is the one an uninterrupted run takes."""
    consumed = position * then_batch
    k = -(-consumed // batch)
    skipped = max(0, min(k, steps_per_epoch) * batch - consumed)
    if k >= steps_per_epoch:
        epoch, k = epoch + 1, 0
    return step - (epoch * steps_per_epoch + k), skipped


def make_sampler(cfg, data, dp_rank: int = 0, dp_size: int = 1) -> Sampler:
    """The sampler ``cfg.data.sampling`` names over ``data``'s training split."""
    if cfg.data.sampling == "random":
        return RandomSampler(data.n_starts, cfg.train.batch_size, seed=cfg.data.seed, dp_rank=dp_rank,
                             dp_size=dp_size)
    return Sampler(data.n_train, cfg.train.batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                   dp_rank=dp_rank, dp_size=dp_size)
