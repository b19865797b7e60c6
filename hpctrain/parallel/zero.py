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

zero = 2 releases gradient memory: on the CPU the gradient buffer (parallel/grad_pages.py,
``ReleasableHost``) lets the pages outside this rank's chunks go as soon as a bucket is
reduce-scattered; they read as zeros afterwards. Up to two buckets' worth of them
(``keep_bytes``) wait in a pool for the next backward pass, which would otherwise fault them in
again; the rest go back to the kernel. The gradients then hold this rank's chunks, 4N/dp
bytes, plus at most two buckets beyond them, or the buckets not yet reduced where those are more.

``parallel.zero_reduce`` says how a bucket is summed (``reduce_choice``): ``Reduce_scatter``, or an
``Allreduce`` in place of which each rank keeps its chunk (twice the bytes on the wire, no other buffer;
DeepSpeed's ``reduce_scatter = false``). Some MPI libraries run the second faster: Open MPI 5 on one node
summed a 25 MB bucket over 2 ranks by Allreduce in 3.5-4.3 ms against 7.3-9.6 ms by Reduce_scatter,
where MPICH took about as long either way (docs/performance.md). At dp = 2 both give the same bits (each
value is one addition, a + b = b + a), so "auto" times the two on a bucket at start-up and takes the faster
(by the slowest times of every data-parallel group: one choice for the whole job); at other dp the two sum
in different orders, and "auto" keeps Reduce_scatter, as on a GPU.
"""

from __future__ import annotations

import mmap
import time

import numpy as np

__all__ = ["ALIGN", "ZeroShard", "split_range", "split_near", "page_unit", "bucket_elems", "overlap",
           "reduce_choice", "time_reductions"]

ALIGN = 16  # elements: 64 bytes, a cache line, so chunks start aligned for the vector units
HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64; the same on every rank, whatever its machine


def page_unit(size: int) -> int:
    """zero = 2 on the host: the elements (a huge page of float32) that bucket and chunk cuts fall on, counted
    from the buffer's end, for a gradient buffer of ``size`` elements of 16 huge pages or more; 0 below that.
    Released memory then leaves and comes back in whole huge pages (parallel/grad_pages.py): a cut inside one
    leaves its pages to be faulted in one 4 KiB page at a time, about 3,700 faults a step on the 50 M MLP of
    docs/performance.md."""
    return HUGE_PAGE // 4 if size * 4 >= 16 * HUGE_PAGE else 0


def split_range(lo: int, hi: int, parts: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """``parts`` contiguous [a, b) pieces covering [lo, hi) in order, balanced, each inner cut ``align``-aligned
    relative to ``lo``: every piece holds at most ``ceil((hi - lo) / parts)`` rounded up to ``align``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    per = -(-(hi - lo) // parts)
    per = -(-per // align) * align
    return [(min(hi, lo + r * per), min(hi, lo + (r + 1) * per)) for r in range(parts)]


def bucket_elems(bucket_mb: float, unit: int = 0) -> float:
    """``parallel.bucket_mb`` in float32 elements, rounded up to a whole number of ``unit`` (``page_unit``)."""
    elems = bucket_mb * 1e6 / 4
    return -(-int(elems) // unit) * unit if unit else elems


def split_near(lo: int, hi: int, parts: int, unit: int, end: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [a, b) pieces covering [lo, hi) in order, each inner cut at the multiple of ``unit``
    counted back from ``end`` nearest to the even cut: every piece within one ``unit`` of ``(hi - lo) / parts``."""
    cuts = [lo]
    for r in range(1, parts):
        even = lo + (hi - lo) * r // parts
        cut = end - (end - even + unit // 2) // unit * unit
        cuts.append(min(hi, max(cuts[-1], cut)))
    cuts.append(hi)
    return list(zip(cuts[:-1], cuts[1:]))


class ZeroShard:
    """What one data-parallel rank owns under ZeRO: chunk ``rank`` of each of ``buckets``.

    ``parts[i]``: every rank's [a, b) chunk of bucket i (rank order), what the collectives move;
    ``updated[i]``: the same less anything from ``limit`` on, what the ranks' optimizers update and
    checkpoints gather; ``pieces[i]``: this rank's of those. Its optimizer slots are one array of
    ``size`` values, the pieces one after another. ``unit`` (``page_unit``; zero = 2 on the host): a bucket of
    at least 3 units a rank is cut on multiples of it counted from the buffer's end (``split_near``).
    """

    def __init__(self, buckets, dp: int, rank: int, align: int = ALIGN, *, limit: int | None = None,
                 unit: int = 0):
        self.buckets, self.dp, self.rank = list(buckets), dp, rank
        top = max((hi for _, hi in self.buckets), default=0)
        self.parts = [split_near(lo, hi, dp, unit, top) if unit and hi - lo >= 3 * dp * unit
                      else split_range(lo, hi, dp, align) for lo, hi in self.buckets]
        # ``limit``: what lies beyond it (a tied tensor's replica, updated by its owner) has no optimizer state
        end = limit if limit is not None else (self.buckets[0][1] if self.buckets else 0)
        self.updated = [[(a, max(a, min(b, end))) for a, b in parts] for parts in self.parts]
        self.pieces = [updated[rank] for updated in self.updated]
        self.size = sum(b - a for a, b in self.pieces)

    def sizes(self) -> list[int]:
        """How many values each rank updates (rank order)."""
        return [sum(updated[r][1] - updated[r][0] for updated in self.updated) for r in range(self.dp)]

    def outside(self) -> list[tuple[int, int]]:
        """The [lo, hi) ranges of every bucket beyond this rank's chunk: what zero = 2 releases once reduced."""
        out = []
        for (lo, hi), parts in zip(self.buckets, self.parts):
            a, b = parts[self.rank]
            out += [(lo, a), (b, hi)] if b > a else [(lo, hi)]
        return [(a, b) for a, b in out if b > a]

    def keep_bytes(self) -> int:
        """zero = 2: how many bytes of gradients beyond this rank's chunks may be in memory at once, released
        pages waiting for the next backward included: two buckets, the largest two (what hpctrain plan counts)."""
        return 4 * sum(sorted(hi - lo for lo, hi in self.buckets)[-2:])

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


def time_reductions(comm, elems: int, rounds: int = 3, *, agree=None) -> tuple[float, float]:
    """Collective over ``comm``, then ``agree`` (a communicator holding it, such as the world's; default
    ``comm``): seconds for one ``Allreduce`` and one ``Reduce_scatter`` over ``comm`` of ``elems`` float32
    values, each the best of ``rounds`` after one untimed round, the slowest rank's of ``agree`` (the same on
    every rank of it). The buffers are a mapping of their own, gone with the last view of it on return, so the
    allocator's thresholds are left as they were."""
    from mpi4py import MPI

    parts = split_range(0, elems, comm.Get_size())
    counts = [b - a for a, b in parts]
    mem = mmap.mmap(-1, 4 * (elems + max(counts)))
    buf = np.frombuffer(mem, np.float32, elems)
    out = np.frombuffer(mem, np.float32, counts[comm.Get_rank()], offset=4 * elems)
    calls = (lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
             lambda: comm.Reduce_scatter(buf, out, counts, op=MPI.SUM))
    best = np.full(2, np.inf)
    for r in range(rounds + 1):  # the first round faults the pages in
        for k, call in enumerate(calls):
            comm.Barrier()
            t0 = time.perf_counter()
            call()
            if r:
                best[k] = min(best[k], time.perf_counter() - t0)
    (agree or comm).Allreduce(MPI.IN_PLACE, best, op=MPI.MAX)
    return float(best[0]), float(best[1])


def reduce_choice(setting: str, comm, elems: int, *, device: bool,
                  agree=None) -> tuple[str, tuple[float, float] | None]:
    """How ZeRO sums a bucket: ("allreduce" or "reduce_scatter", the start-up timings (Allreduce, Reduce_scatter)
    in seconds where "auto" took them, else None). Collective over ``comm`` (the data-parallel group) and
    ``agree`` (every group: the world) when ``setting`` is "auto", ``comm`` has 2 ranks and ``device`` is false:
    each group times a bucket of ``elems`` values, and the slowest times of all decide, the same way on every
    rank of ``agree``. Elsewhere "auto" is "reduce_scatter"."""
    if setting != "auto":
        return setting, None
    if device or comm.Get_size() != 2:
        return "reduce_scatter", None
    timed = time_reductions(comm, max(1, elems), agree=agree)
    return ("allreduce" if timed[0] < timed[1] else "reduce_scatter"), timed
