"""ZeRO over data parallelism: which slice of a part's flat buffer each data-parallel rank owns.

    [parallel]
    dp = 4
    zero = 1      # optimizer state sharded over dp: Adam's 8 bytes per parameter become 8/dp
    zero = 2      # and gradients: a bucket, once reduce-scattered, keeps only this rank's slice in memory

With ``parallel.zero >= 1`` each data-parallel rank of a stage owns one contiguous, balanced
slice ``[lo, hi)`` of the part's flat buffer (``zero_slices``: every rank computes the same cut
from the buffer size alone, so nothing needs agreeing at run time beyond the layout hash that
start-up already compares). The gradient sync reduce-scatters each bucket into the owners'
slices (parallel/data_parallel.py: ``Reduce_scatter`` with per-rank counts, the reduce half of
an Allreduce), the optimizer steps its slots for the slice only, and the parameters are
all-gathered back bucket by bucket (the other half): the same bytes on the wire as an
Allreduce, as in DeepSpeed ZeRO-1/2, Megatron-core's distributed optimizer and llm.c.

zero = 2 releases gradient memory: on the CPU the gradient buffer is an anonymous private
mapping (``ReleasableHost``) whose pages outside this rank's slice are handed back to the
kernel (``madvise(MADV_DONTNEED)``) as soon as a bucket is reduce-scattered; they read as
zeros afterwards and are faulted in again by the next backward pass. Between steps and during
the forward pass the gradients then hold this rank's slice, 4N/dp bytes, plus the buckets not
yet reduced.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["ALIGN", "zero_slices", "overlap", "ReleasableHost"]

ALIGN = 16  # elements: 64 bytes, a cache line, so slices start aligned for the vector units


def zero_slices(size: int, dp: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """``dp`` contiguous [lo, hi) slices covering ``range(size)``, balanced, every inner cut a multiple of ``align``.

    Slice r holds ``ceil(size / dp)`` elements rounded up to ``align`` (the last ones fewer, possibly none):
    every rank's optimizer state is at most one alignment pad above 1/dp of the buffer.
    """
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    per = -(-size // dp)
    per = -(-per // align) * align
    return [(min(size, r * per), min(size, (r + 1) * per)) for r in range(dp)]


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
