"""Bit-identical training on any number of ranks: ``train.deterministic = true``.

    [train]
    batch_size = 64
    deterministic = true
    deterministic_shards = 4    # the global batch in 4 logical shards of 16 samples: dp may be 1, 2 or 4

A float sum's bits depend on its order, and data parallelism changes the order: dp = 1 adds a
step's rows in one GEMM, dp = 2 adds two halves and then Allreduces them (in an order MPI picks).
Deterministic mode fixes every sum a step makes, whatever the layout:

* the global batch is cut into ``S = train.deterministic_shards`` logical shards of B/S samples
  (shard s: samples s·B/S .. (s+1)·B/S − 1 of the step's batch), and each shard's forward and
  backward run as one micro-batch, in the same shapes wherever it runs: data-parallel rank r
  computes shards r·S/dp .. (r+1)·S/dp − 1, one micro-batch each (``train.micro_batches`` is
  replaced by S/dp: hpctrain/run_plan.py, from ``shards_per_rank``);
* the shard gradients are summed in one fixed binary tree over the S shards: the shards of one
  rank form a subtree summed locally (``ShardTree``), and the ranks' subtrees meet by recursive
  doubling over the data-parallel group (``tree_allreduce``: at level l rank r adds rank
  r XOR 2^l's partial sum, the same two values on both sides), so S and dp are powers of two;
* the two halves of a tied tensor's gradient (the GPT's head and its token embedding) are each
  summed by the tree and only then added, on one stage as across two (nn/model.py: ``split_ties``);
* the gradient norm is a ``math.fsum`` of per-tensor sums of squares (a tensor is whole on one
  stage in every pipeline layout), and the logged and evaluated losses are sums of per-shard (or
  per-chunk) values in shard order (``ordered_sum``);
* BLAS runs one thread per rank: OpenBLAS's GEMM bits change with its thread count.

Outside the guarantee (the start-up line says so): tensor parallelism (it changes a GEMM's split),
ZeRO, the parameter server and the zero-bubble schedule (refused), another BLAS, CPU model or backend.

The tree sends a bucket log2(dp) times (an Allreduce: about twice), and each rank runs S/dp
micro-batches of B/S samples; docs/performance.md has what that costs.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from .schedule import SPLIT_BACKWARD

__all__ = ["shards_per_rank", "notes", "ShardTree", "tree_allreduce", "ordered_sum"]


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def shards_per_rank(shards: int, *, dp: int, zero: int, schedule: str) -> int:
    """The micro-batches a rank runs a step: its ``shards`` / dp; ConfigError naming the setting when the layout
    cannot hold the shards. ``zero``, ``schedule``: as they take effect (hpctrain/run_plan.py: zero 0 with one
    data-parallel rank, "1f1b" without a pipeline)."""
    if zero:
        raise ConfigError("train.deterministic: not with parallel.zero > 0 yet (its reduce-scatter sums in MPI's "
                          "order); set parallel.zero = 0")
    if schedule in SPLIT_BACKWARD:
        raise ConfigError(f'train.deterministic: not with parallel.schedule = "{schedule}" (a micro-batch\'s weight '
                          "gradients are written after the next one's input gradients, so each shard's gradient "
                          'is never whole on its own); use "1f1b"')
    if not _power_of_two(dp) or shards % dp:
        raise ConfigError(f"train.deterministic: dp = {dp} must be a power of two dividing "
                          f"train.deterministic_shards = {shards} (each rank sums a subtree of the shards); runs to "
                          "compare bitwise need the same shards, as many as the most ranks any of them uses")
    return shards // dp


def notes(shards: int, *, batch_size: int, dp: int, tp: int, asked: int) -> list[str]:
    """The start-up lines of a deterministic run: ``asked`` (train.micro_batches) replaced, when it is, and what
    the guarantee covers."""
    m = shards // dp
    lines = []
    if asked not in (1, m):
        lines.append(f"train.deterministic: train.micro_batches = {asked} replaced by {m} "
                     f"(deterministic_shards {shards} / dp {dp})")
    covered = ("bitwise the same for any power-of-two dp dividing the shards, any pp and micro-batch count, "
               "on this backend and CPU model")
    lines.append(f"train.deterministic: {shards} shards of {batch_size // shards} samples, {m} per rank; "
                 + (covered if tp == 1 else f"tp = {tp} splits the GEMMs: bitwise the same only among runs at "
                    f"tp = {tp}"))
    return lines


def ordered_sum(values) -> float:
    """Σ values (float64) in a fixed pairwise tree over their order: the same bits from the same values in the
    same order, wherever they were computed."""
    vals = [float(v) for v in values]
    if not vals:
        return 0.0
    while len(vals) > 1:
        vals = [vals[i] + vals[i + 1] if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


class ShardTree:
    """The local part of the fixed pairwise tree over one step's shard gradients, in place in ``grads``.

    Each shard's backward writes its gradient into ``grads`` (no accumulation); ``push(leaf, lo, hi)`` then
    adds into [lo, hi) every finished sibling subtree the leaf completes and, unless that made the root, parks
    the result for its own sibling. Leaves may arrive in any order; the root's sum is left in ``grads``. At most
    log2(leaves) parked buffers of ``grads``'s size live at once (arrival in order), made on first use and kept.
    """

    def __init__(self, backend, grads, leaves: int):
        if not _power_of_two(leaves):
            raise ValueError(f"the shard tree needs a power-of-two number of leaves, got {leaves}")
        self.be, self.grads, self.leaves = backend, grads, leaves
        self.levels = leaves.bit_length() - 1
        self._free, self._parked = [], {}  # (level, node) -> a buffer holding that subtree's sum

    @property
    def parked_bytes(self) -> int:
        """Bytes of the buffers made for parked sums (after a step: log2(leaves) of them, arrival in order)."""
        return sum(int(b.nbytes) for b in list(self._free) + list(self._parked.values()))

    def start(self) -> None:
        self._free += self._parked.values()
        self._parked = {}

    def chain(self, leaf: int) -> list:
        """The parked subtrees leaf ``leaf`` meets on its way up, lowest first; where it stops."""
        level, node, found = 0, leaf, []
        while level < self.levels and (level, node ^ 1) in self._parked:
            found.append((level, node ^ 1))
            level, node = level + 1, node >> 1
        return found, (level, node)

    def push(self, leaf: int, lo: int, hi: int, *, last_slice: bool = True) -> None:
        """Leaf ``leaf``'s gradient, in ``grads[lo:hi]``, up the tree; ``last_slice``: the leaf's whole range is
        done after this call (the parked siblings it used are freed, its own subtree parked)."""
        if self.leaves == 1:
            return
        found, (level, node) = self.chain(leaf)
        part = self.grads[lo:hi]
        for key in found:  # left + right or right + left: the same bits (float addition commutes)
            self.be.add_(part, self._parked[key][lo:hi])
        if level < self.levels:
            if (level, node) not in self._parked:
                self._parked[(level, node)] = self._free.pop() if self._free else self.be.empty(self.grads.shape)
            self.be.copy_(self._parked[(level, node)][lo:hi], part)
        if last_slice:
            for key in found:
                self._free.append(self._parked.pop(key))


def tree_allreduce(comm, buf, scratch, add) -> None:
    """Sum ``buf`` over ``comm`` (a power-of-two size) by recursive doubling, in place: at level l each rank swaps
    its partial sum with rank XOR 2^l and adds, so every rank ends with the same bits (collective over ``comm``;
    ``scratch``: a buffer of ``buf``'s size and kind to receive into; ``add(buf, scratch)``: buf += scratch)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if not _power_of_two(size):
        raise ValueError(f"recursive doubling needs a power-of-two communicator, got {size} ranks")
    bit = 1
    while bit < size:
        comm.Sendrecv(buf, dest=rank ^ bit, sendtag=bit, recvbuf=scratch, source=rank ^ bit, recvtag=bit)
        add(buf, scratch)
        bit <<= 1


def tensor_norm2(piece_sums, ranges_by_tensor, count: int) -> np.ndarray:
    """A float64 vector of ``count`` per-tensor sums of squares (global tensor index -> value; 0 where this rank
    counts no part of the tensor) from ``piece_sums``, the sums of squares of the pieces ``ranges_by_tensor``
    lists ((index, lo, hi) each, in that order): summed over the ranks of a stage's other groups, each entry has
    one contributor and the sum is exact."""
    out = np.zeros(count, dtype=np.float64)
    for (index, _, _), value in zip(ranges_by_tensor, piece_sums):
        out[index] += value
    return out


def norm_of(vector: np.ndarray) -> float:
    """The gradient norm from the per-tensor vector, rounded once (``math.fsum``): independent of any order."""
    total = math.fsum(float(v) for v in vector)
    return math.sqrt(total) if total >= 0 else float("nan")
