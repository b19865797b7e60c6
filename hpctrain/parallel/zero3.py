"""ZeRO-3 over data parallelism: the parameters sharded too, each unit's gathered around its use.

    [parallel]
    dp = 4
    zero = 3      # parameters, gradients and optimizer state sharded over dp (FSDP / DeepSpeed ZeRO-3)

A rank keeps the same chunks of the flat parameter buffer as its ZeRO-1/2 optimizer updates (parallel/zero.py,
``ZeroShard``: chunk r of every bucket); the rest of the buffer's pages are released (parallel/grad_pages.py,
``ReleasableHost``, the buffer zero = 2 keeps its gradients in). Before a partition unit runs (an MLP's Linear with
its activation, the GPT's embedding, a block, the head with its tied ``wte``), forward and again before its
backward (and so before a recomputed forward), ``ParamGather.use`` fills its pages from a pool of released ones and
all-gathers its values over dp, bucket by bucket, in place (``Allgatherv``: each rank's chunk of each bucket,
clipped to the unit); ``done`` releases them into the pool again. The next unit's gather is posted
(``Iallgatherv``) while the current one computes: the unit the step uses next, in the order its schedule's
instructions use them (``unit_uses``, handed to ``expect`` by the executor at each step: forwards and backwards of
micro-batches and, interleaved, of a stage's chunks), so at most two units are gathered at once, and the pool holds the two largest units' pages (what ``hpctrain plan`` counts).
The gathers run over a duplicate of the data-parallel communicator: zero 2's communication thread reduces
gradient buckets over the original at the same time.

What a rank holds, when: its chunks of the parameters (4N/dp bytes), of the gradients (4N/dp, plus the buckets in
flight, as zero 2) and of the optimizer state (Adam 8N/dp) all the time; a unit's full parameters from its
``use`` to its ``done`` (two units at most). After the optimizer step nothing is all-gathered: the next forward
gathers what it needs. Evaluation gathers the whole model once (``whole``) and releases it after.

Collective calls: ``use``/``done`` (through ``ModelPart.forward``/``backward``), ``whole`` and ``release_all``
must run on every data-parallel rank in the same order; they do, as every rank runs the same units per step.
"""

from __future__ import annotations

import contextlib

from .grad_pages import merged_ranges

__all__ = ["ParamGather", "unit_uses", "unit_ranges", "without", "refusal", "param_pieces", "gathered_whole", "tied_ranges"]


def refusal(cfg, *, device: bool = False) -> str:
    """Why ``parallel.zero = 3`` cannot run with ``cfg`` in this version ("" where it can)."""
    p, t = cfg.parallel, cfg.train
    if t.deterministic:
        return "parallel.zero = 3 with train.deterministic is not supported yet; use zero = 0 there"
    if device:
        return ("parallel.zero = 3 on a GPU is not supported yet (the CPU backend only); use zero = 2 there, or "
                "train.backend = \"cpu\"")
    return ""


def unit_uses(part, instructions) -> list[int]:
    """The partition units (``ParamGather``'s numbering: chunk by chunk) a stage's ``instructions`` use, in order:
    a Forward its chunk's units first to last, a Backward or a zero-bubble B last to first (its recomputed
    forward too, inside the same use), a W none (it reads what its B saved)."""
    from .instructions import Backward, BackwardInput, Forward

    first = [0]
    for units in part.chunk_units:
        first.append(first[-1] + len(units))
    out = []
    for ins in instructions:
        if isinstance(ins, (Forward, Backward, BackwardInput)):
            units = range(first[ins.chunk], first[ins.chunk + 1])
            out += units if isinstance(ins, Forward) else reversed(units)
    return out


def unit_ranges(part) -> list[list[tuple[int, int]]]:
    """Each partition unit's [lo, hi) ranges of the part's flat buffer: the tensors its layers own or tie to."""
    out = []
    for a, b in part.units:
        spans = []
        for k in range(a, b + 1):
            layer, prefix = part.layers[k], part.prefixes[k]
            names = [prefix + n for n, _ in layer.params] + [prefix + n for n, _ in layer.ties]
            spans += [(part.layout[n].offset, part.layout[n].end) for n in names]
        out.append(merged_ranges(spans))
    return out


def without(ranges, holes) -> list[tuple[int, int]]:
    """The parts of ``ranges`` outside every [lo, hi) of ``holes``."""
    out = []
    for lo, hi in ranges:
        at = lo
        for a, b in sorted(holes):
            if b <= at or a >= hi:
                continue
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < hi:
            out.append((at, hi))
    return out


def tied_ranges(part) -> list[tuple[int, int]]:
    """The [lo, hi) ranges of the part's tied tensors: each shared one (its owner's or its replica's values) and
    each local tie's two ends (parallel/tied.py's ``refresh_replicas`` reads and writes them)."""
    names = list(part.shared) + [name for pair in part.local_ties for name in pair]
    return merged_ranges([(part.layout[n].offset, part.layout[n].end) for n in names])


def param_pieces(part, shard) -> list:
    """The checkpoint pieces (checkpoint/pieces.py) of this rank's parameter chunks, at their places in the flat
    buffer: what a zero 3 rank writes of the parameters (every rank its own, as its optimizer slots; a tensor
    every tensor-parallel rank holds whole, tensor-parallel rank 0's alone)."""
    import dataclasses

    from ..checkpoint.pieces import held

    tp_rank = part.tp.rank if part.tp is not None else 0
    out = []
    for a, b in shard.pieces:
        out += [dataclasses.replace(p, at=p.at + a) for p in held(part, [(a, b)])[1]
                if p.kind is not None or tp_rank == 0]
    return out


def gathered_whole(gather, evaluate):
    """``evaluate`` with the whole model gathered around it (its data-parallel ranks may run different numbers
    of forwards, so no unit's gather could match)."""
    def run(*args, **kwargs):
        with gather.whole():
            return evaluate(*args, **kwargs)
    return run


class ParamGather:
    """The gathers and releases of one rank's parameter buffer under zero = 3 (CPU; see the module docstring).

    ``params``: the part's flat parameter array (a ``ReleasableHost``'s, ``memory``); ``shard``: the ZeroShard
    whose chunks this rank keeps; ``comm``: the data-parallel communicator (duplicated here; ``close`` frees it).
    ``prefetch``: post the next unit's gather while the current one runs.
    """

    def __init__(self, part, shard, memory, comm, *, prefetch: bool = True):
        from mpi4py import MPI

        self.MPI, self.memory, self.shard, self.prefetch = MPI, memory, shard, prefetch
        self.params = memory.array
        self.comm = comm.Dup()
        self.units = unit_ranges(part)
        own = [parts[shard.rank] for parts in shard.parts]
        self.outside = [without(r, own) for r in self.units]  # what each unit releases after use
        # per unit: (bucket [lo, hi) clipped to one of its ranges, every rank's count and displacement in it)
        self.segments = [self._segments(r) for r in self.units]
        self._posted = {}  # unit -> its gather's requests (posted ahead)
        self._held = set()  # units gathered and not yet done
        self._uses, self._at = None, 0  # the step's units in the order of their use (``expect``), the next's place
        self._last = None  # without ``expect``: the unit used last, the next one after it (forward) or before it
        self._direction = 1
        self.unplanned = 0  # steps whose uses left the order ``expect`` gave (the tests keep it 0)
        self.gathered_bytes = 0  # over the run: what this rank received
        self.released_bytes = 0  # over the run: what ``done`` gave back (whole pages only)

    @staticmethod
    def pool_bytes(part) -> int:
        """The two largest units' bytes: what may be gathered at once (a unit and the next, prefetched)."""
        sizes = sorted(sum(b - a for a, b in r) for r in unit_ranges(part))
        return 4 * sum(sizes[-2:])

    @staticmethod
    def tracked(part, shard) -> list[tuple[int, int]]:
        """The ranges whose released pages move through the pool: each unit's outside this rank's chunks."""
        own = [parts[shard.rank] for parts in shard.parts]
        return merged_ranges([x for r in unit_ranges(part) for x in without(r, own)])

    def _segments(self, ranges):
        segs = []
        for (lo, hi), parts in zip(self.shard.buckets, self.shard.parts):
            for a, b in ranges:
                x, y = max(lo, a), min(hi, b)
                if x >= y:
                    continue
                clipped = [(min(max(p, x), y), min(max(q, x), y)) for p, q in parts]
                segs.append((x, y, [q - p for p, q in clipped], [p - x for p, _ in clipped]))
        return segs

    def _post(self, u: int, blocking: bool):
        for lo, hi in self.outside[u]:
            self.memory.fill(lo, hi)
        reqs = []
        for x, y, counts, displs in self.segments[u]:
            msg = [self.params[x:y], counts, displs, self.MPI.FLOAT]
            if blocking:
                self.comm.Allgatherv(self.MPI.IN_PLACE, msg)
            else:
                reqs.append(self.comm.Iallgatherv(self.MPI.IN_PLACE, msg))
            self.gathered_bytes += 4 * (y - x - counts[self.shard.rank])
        return reqs

    def expect(self, uses) -> None:
        """The units a step will use, in order (``unit_uses`` of the stage's instructions: a pipeline's forwards
        and backwards of its micro-batches and chunks interleaved as its schedule has them). Each ``use`` then
        posts the gather of the next other unit in this order, and ``done`` keeps a unit only when the next use
        is that unit again, so at most two units are gathered at once on any schedule."""
        self._uses, self._at = list(uses), 0

    def _next_use(self, u: int):
        """With ``expect``: (the unit after this use other than u, whether u itself is used next); else None."""
        if self._uses is None:
            return None
        if self._at >= len(self._uses) or self._uses[self._at] != u:
            self._uses = None  # off the expected order (a forward outside the step): the fallback's guess
            self.unplanned += 1
            return None
        self._at += 1
        nxt = next((v for v in self._uses[self._at :] if v != u), None)
        return nxt, self._at < len(self._uses) and self._uses[self._at] == u

    def use(self, u: int) -> None:
        """Unit u's full parameters in place (collective over dp); the next unit's gather posted."""
        if self.gather_off:
            return
        planned = self._next_use(u)
        if self._last is not None and u != self._last:
            self._direction = 1 if u > self._last else -1
        self._last = u
        if u in self._posted:
            self.MPI.Request.Waitall(self._posted.pop(u))
        elif u not in self._held:
            self._post(u, blocking=True)
        self._held.add(u)
        nxt = planned[0] if planned is not None else u + self._direction
        self._again = planned is not None and planned[1]
        if self.prefetch and nxt is not None and 0 <= nxt < len(self.units) and nxt not in self._held \
                and nxt not in self._posted:
            self._posted[nxt] = self._post(nxt, blocking=False)

    _again = False  # the unit just used is the next one used too (``expect``): ``done`` keeps it

    def done(self, u: int) -> None:
        """Unit u's gathered values leave (their pages to the pool); not collective. The unit used next again
        stays (a backward that starts with the unit its forward ended with)."""
        if self.gather_off:
            return
        if self._uses is not None:
            if self._again:
                return
        elif self._direction == 1 and u == len(self.units) - 1:
            self._direction = -1  # the backward comes next, starting with this unit
            return
        if self._direction == -1 and u == 0:
            self._direction = 1  # the next micro-batch's forward comes next
        self._held.discard(u)
        busy = [x for v in set(self._held) | set(self._posted) for x in self.units[v]]  # a tied tensor: both
        for lo, hi in without(self.outside[u], busy):
            self.released_bytes += self.memory.release(lo, hi)

    def release_all(self) -> None:
        """Every value outside this rank's chunks leaves (after start-up, evaluation, a step's end)."""
        for u in list(self._posted):
            self.MPI.Request.Waitall(self._posted.pop(u))
        for ranges in self.outside:
            for lo, hi in ranges:
                self.memory.release(lo, hi)
        self._held.clear()
        self._last, self._direction = None, 1
        self._uses, self._again = None, False

    @contextlib.contextmanager
    def tied(self, ranges):
        """The full values of ``ranges`` (``tied_ranges``: the tied tensors, owner and replica) for the block, for
        ``refresh_replicas`` after a step: the owner sends the whole updated tensor, the replica receives it
        whole; released after (collective over dp). Its chunks keep what the next forward gathers."""
        own = [parts[self.shard.rank] for parts in self.shard.parts]
        outside = without(ranges, own)
        for lo, hi in outside:
            self.memory.fill(lo, hi)
        for x, y, counts, displs in self._segments(ranges):
            self.comm.Allgatherv(self.MPI.IN_PLACE, [self.params[x:y], counts, displs, self.MPI.FLOAT])
            self.gathered_bytes += 4 * (y - x - counts[self.shard.rank])
        try:
            yield
        finally:
            for lo, hi in outside:
                self.released_bytes += self.memory.release(lo, hi)

    @contextlib.contextmanager
    def whole(self):
        """The whole model gathered for the block's duration (evaluation), released after (collective)."""
        self.release_all()
        for u in range(len(self.units)):
            self._post(u, blocking=True)
        self.gather_off = True
        try:
            yield
        finally:
            self.gather_off = False
            self.release_all()

    gather_off = False

    def close(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
