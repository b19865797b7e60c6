"""ZeRO over data parallelism: which slice of a part's flat buffer each data-parallel rank owns.

    [parallel]
    dp = 4
    zero = 1      # optimizer state sharded over dp: Adam's 8 bytes per parameter become 8/dp
    zero = 2      # and gradients: a bucket, once reduce-scattered, keeps only this rank's slice in memory

With ``parallel.zero >= 1`` the gradient buffer's buckets (parallel/data_parallel.py) are each
cut into ``dp`` balanced, aligned chunks, and data-parallel rank r owns chunk r of every bucket
(``ZeroShard``; every rank computes every rank's chunks from the buffer size and bucket size
alone, so nothing needs agreeing beyond the layout hash start-up already compares). Each bucket
is reduce-scattered into its owners' chunks (``Reduce_scatter``, the reduce half of an
Allreduce), the optimizer steps its slots for the rank's chunks only, and the parameters are
all-gathered back bucket by bucket (``Allgatherv``, the other half): the same bytes on the
wire as an Allreduce, as in DeepSpeed ZeRO-1/2 and Megatron-core's distributed optimizer,
whose buffers are split per bucket the same way. A contiguous 1/dp slice of the whole buffer
per rank (llm.c's) would send each bucket to one rank: MPICH's Reduce_scatter of a 25 MB
bucket then took 10.5 ms against 6.6 ms split evenly at dp 2, and 50 ms against 13.8 ms at dp 4
(docs/performance.md).

zero = 2 releases gradient memory: on the CPU the gradient buffer is an anonymous private
mapping (``ReleasableHost``) whose pages outside this rank's chunks are handed back to the
kernel (``madvise(MADV_DONTNEED)``) as soon as a bucket is reduce-scattered; they read as
zeros afterwards and are faulted in again by the next backward pass. Between steps and during
the forward pass the gradients then hold this rank's chunks, 4N/dp bytes, plus the buckets not
yet reduced.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["ALIGN", "ZeroShard", "split_range", "overlap", "ReleasableHost"]

ALIGN = 16  # elements: 64 bytes, a cache line, so chunks start aligned for the vector units


def split_range(lo: int, hi: int, parts: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """``parts`` contiguous [a, b) pieces covering [lo, hi) in order, balanced, each inner cut ``align``-aligned
    relative to ``lo``: every piece holds at most ``ceil((hi - lo) / parts)`` rounded up to ``align``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    per = -(-(hi - lo) // parts)
    per = -(-per // align) * align
    return [(min(hi, lo + r * per), min(hi, lo + (r + 1) * per)) for r in range(parts)]


class ZeroShard:
    """What one data-parallel rank owns under ZeRO: chunk ``rank`` of each of ``buckets``.

    ``parts[i]``: every rank's [a, b) chunk of bucket i (rank order), what the collectives move;
    ``updated[i]``: the same less anything from ``limit`` on, what the ranks' optimizers update and
    checkpoints gather; ``pieces[i]``: this rank's of those. Its optimizer slots are one array of
    ``size`` values, the pieces one after another.
    """

    def __init__(self, buckets, dp: int, rank: int, align: int = ALIGN, *, limit: int | None = None):
        self.buckets, self.dp, self.rank = list(buckets), dp, rank
        self.parts = [split_range(lo, hi, dp, align) for lo, hi in self.buckets]
        # ``limit``: what lies beyond it (a tied tensor's replica, updated by its owner) has no optimizer state
        end = limit if limit is not None else (self.buckets[0][1] if self.buckets else 0)
        self.updated = [[(a, max(a, min(b, end))) for a, b in parts] for parts in self.parts]
        self.pieces = [updated[rank] for updated in self.updated]
        self.size = sum(b - a for a, b in self.pieces)

    def sizes(self) -> list[int]:
        """How many values each rank updates (rank order)."""
        return [sum(updated[r][1] - updated[r][0] for updated in self.updated) for r in range(self.dp)]

    def place(self, out, rank: int, values) -> None:
        """Rank ``rank``'s pieces (``values``, one after another) into their places in ``out``."""
        at = 0
        for a, b in (updated[rank] for updated in self.updated):
            out[a:b] = values[at : at + b - a]
            at += b - a


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The intersection of two [lo, hi) ranges (empty: lo == hi)."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, max(lo, hi))


class ReleasableHost:
    """A zeroed float32 host array whose pages can be handed back to the kernel (Linux ``MADV_DONTNEED``).

    A private anonymous mapping: released pages read as zeros and cost no memory until written again.
    Where ``madvise`` is missing the array is plain memory and ``release`` does nothing.
    """

    def __init__(self, n: int):
        self.n = int(n)
        nbytes = max(1, self.n) * 4
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        self._map = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
        self.array = np.frombuffer(self._map, dtype=np.float32, count=self.n)
        self.releasable = hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED")
        if self.releasable and hasattr(mmap, "MADV_HUGEPAGE"):
            # transparent huge pages where the kernel allows them: a released bucket is faulted in again by
            # the next backward pass, 2 MiB at a time instead of 4 KiB
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass

    def release(self, lo: int, hi: int) -> int:
        """Hand back the whole pages inside elements [lo, hi); returns the bytes released."""
        if not self.releasable or hi <= lo:
            return 0
        page = mmap.PAGESIZE
        start = -(-(lo * 4) // page) * page
        end = (hi * 4) // page * page
        if end <= start:
            return 0
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        return end - start
