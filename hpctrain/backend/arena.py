"""A training step's device arrays carved out of one allocation that the step itself planned (issue 49 item 1).

llm.c lays every activation of a step out by hand in one ``malloc`` (``malloc_and_point_activations``). hpctrain's
layers ask the backend for their arrays as they go (``backend.empty``), in an order that depends on the model,
the schedule and the layout, so the arena learns the layout from the step instead:

1. **Record.** The first step run inside ``StepArena.step()`` allocates as before (the caching pool), and the
   arena notes each request (shape, dtype) in order, and when each array dies: before request ``t`` it looks at
   the arrays still alive and stamps those nobody holds any more (no view, no slice, no reference outside the
   arena: ``refs`` names the objects whose reference counts say so) with death ``t``. An array still held when
   the step ends has escaped the step (a value someone keeps), and is left out of the plan.
2. **Plan.** ``plan_offsets`` replays the requests on an address space with a best-fit free list: each array
   gets an offset, memory is shared only between arrays whose lifetimes do not overlap, and the high-water mark
   is the size of the one slab the backend allocates. Each planned request gets its array over the slab once,
   here, and keeps it.
3. **Replay.** Every later step's request ``t`` is handed the same array object: no allocation, no array
   wrapper built, the same address every step (what a CUDA graph needs to replay the step). Before request
   ``t`` the arena checks that the arrays the plan let die by then are dead; at the step's end, that every
   planned array is.

Anything else, and the arena steps aside for the rest of the step and records the next one: a request of
another shape or dtype (``reason``: which and where), more requests than planned, or an array still alive
that the plan lets another reuse. Code that hands an array to another thread says so (``backend.lend``: the
pipeline's sends), and the plan keeps that array's memory to the step's end, whenever the thread lets go of it
(which it must by then). A fresh allocation is always correct, so a step that leaves the plan
computes the same values; the arrays already handed out keep the old slab alive until they die. Requests from
another thread (a communication thread's copies) never go to the arena.

The arena is exact by construction, not by trust: the reference counts are checked on every replay, and the
tests (tests/cuda/test_cuda_arena.py) train with the arena on and off under the simulator and compare bits.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

__all__ = ["StepArena", "plan_offsets", "peak_bytes", "ALIGN"]

ALIGN = 512  # bytes: every array starts on the caching pool's granule (cudaMalloc's alignment or better)


def _nbytes(shape, dtype) -> int:
    return -(-math.prod(shape) * np.dtype(dtype).itemsize // ALIGN) * ALIGN


def plan_offsets(sizes, births, deaths) -> tuple[list[int], int]:
    """Offsets for arrays of ``sizes`` bytes (multiples of ALIGN) alive over [births[i], deaths[i]) (request
    counts), born in increasing order: a best-fit free list, the space freed at ``t`` usable by the array born at
    ``t``. Returns (offsets, bytes in all)."""
    free: list[list[int]] = []  # [offset, size], sorted by offset, coalesced
    top = 0
    ends = sorted(range(len(sizes)), key=lambda i: deaths[i])
    e = 0
    offsets = [0] * len(sizes)
    for i, (size, birth) in enumerate(zip(sizes, births)):
        while e < len(ends) and deaths[ends[e]] <= birth:
            j = ends[e]
            if deaths[j] > births[j]:
                top = _release(free, offsets[j], sizes[j], top)
            e += 1
        best = None
        for k, (off, room) in enumerate(free):
            if room >= size and (best is None or room < free[best][1]):
                best = k
        if best is None:  # grow the top (taking a free block that ends there)
            if free and free[-1][0] + free[-1][1] == top:
                off = free.pop()[0]
            else:
                off = top
            top = off + size
        else:
            off = free[best][0]
            if free[best][1] == size:
                free.pop(best)
            else:
                free[best] = [off + size, free[best][1] - size]
        offsets[i] = off
    return offsets, top


def peak_bytes(sizes, births, deaths) -> int:
    """The most bytes alive at once over arrays alive over [births[i], deaths[i]): what no plan can go under."""
    events = sorted([(b, s) for s, b in zip(sizes, births)] + [(d, -s) for s, d in zip(sizes, deaths)],
                    key=lambda e: (e[0], e[1]))  # at one time, frees before allocations
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def _release(free, off, size, top):
    """Give [off, off + size) back to the free list (merged with its neighbours); returns the top."""
    k = 0
    while k < len(free) and free[k][0] < off:
        k += 1
    free.insert(k, [off, size])
    if k + 1 < len(free) and free[k][0] + free[k][1] == free[k + 1][0]:
        free[k][1] += free.pop(k + 1)[1]
    if k > 0 and free[k - 1][0] + free[k - 1][1] == free[k][0]:
        free[k - 1][1] += free.pop(k)[1]
    return top


class _Held:
    """An array and the objects whose reference counts tell whether anything outside the arena holds it.

    ``settle()`` takes the counts of the moment as the ones of an array only the arena holds: call it where no
    local variable or argument holds the array (``_hold`` does)."""

    __slots__ = ("array", "refs", "base")

    def __init__(self, array, refs):
        self.array, self.refs, self.base = array, refs(array), None

    def settle(self):
        self.base = self.counts()

    def counts(self):
        return [sys.getrefcount(o) for o in self.refs]

    def dead(self) -> bool:
        return self.counts() == self.base


def _hold(array, refs) -> _Held:
    held = _Held(array, refs)
    del array  # the caller's value is gone once this returns; this frame's name for it goes now
    held.settle()
    return held


class StepArena:
    """One step's requests, recorded once and replayed after (above). The backend gives it:

    ``fresh(shape, dtype)``: an array as without the arena; ``slab(nbytes)``: one allocation of that many bytes;
    ``carve(slab, offset, shape, dtype)``: an array over the slab at ``offset`` (its own view object, so its
    reference count is its own); ``refs(array)``: the objects that every view of the array references;
    ``root(array)``: the one object all views of its memory share (``lend`` finds the request by it).
    """

    def __init__(self, *, fresh, slab, carve, refs, root=None):
        self._fresh, self._slab, self._carve, self._refs = fresh, slab, carve, refs
        self._root = root if root is not None else (lambda a: a)
        self._lent: set = set()  # record: requests lent to another thread (alive to the step's end)
        self._owner = None  # the thread inside step(), whose requests the arena serves
        self._mode = None  # "record", "replay" or "aside" inside a step
        self._t = 0
        self._log: list = []  # record: (shape, dtype str) per request
        self._live: list = []  # record: (request, _Held)
        self._deaths: list = []
        self._plan = None  # replay: list of (shape, dtype str, _Held or None: escaped, fresh each step)
        self._dies_at: dict = {}  # request -> the planned arrays that must be dead by then
        self._keep = None  # the slab of the plan
        self.slab_bytes = 0
        self.peak_bytes = 0  # the most bytes of the plan alive at once: the slab is at least this
        self.plans = self.served = 0
        self.reason = ""  # why the last step left the plan ("" while it holds)

    # ------------------------------------------------------------------ the step

    @property
    def replaying(self) -> bool:
        """Inside a step served from the plan so far (the addresses of the recorded step)."""
        return self._mode == "replay"

    def step(self):
        """A context manager around one training step."""
        return _Scope(self)

    def _enter(self):
        self._owner, self._t = threading.get_ident(), 0
        if self._plan is not None:
            self._mode = "replay"
        else:
            self._mode, self._log, self._live, self._deaths, self._lent = "record", [], [], [], set()

    def _exit(self, ok: bool):
        mode, self._owner, self._mode = self._mode, None, None
        if mode == "record":
            self._stamp(self._t, end=True)
            if ok:
                self._make_plan()
            self._live = []
        elif mode == "replay":
            if self._t != len(self._plan):
                self._leave(f"the step made {self._t} of the plan's {len(self._plan)} requests")
            else:
                held = self._dies_at.get(len(self._plan), ())
                if not all(h.dead() for h in held):
                    self._leave("an array the plan lets go at the step's end is still held after it")
        # "aside": the plan is gone already; the next step records

    def _leave(self, why: str):
        self.reason, self._plan, self._dies_at, self._keep = why, None, {}, None
        self._mode = "aside"

    # ------------------------------------------------------------------ requests

    def request(self, shape, dtype):
        """An array for the owning thread's request inside a step; None: the caller allocates as usual (outside a
        step, another thread's request, a step that left the plan)."""
        if self._mode is None or threading.get_ident() != self._owner:
            return None
        t, key = self._t, (tuple(shape), np.dtype(dtype).str)
        self._t += 1
        if self._mode == "record":
            self._stamp(t)
            held = _hold(self._fresh(shape, dtype), self._refs)
            self._log.append(key)
            self._deaths.append(None)
            self._live.append((t, held))
            return held.array
        if self._mode == "replay":
            if t >= len(self._plan) or self._plan[t][0] != key:
                got = f"{key[0]} {np.dtype(key[1]).name}"
                want = ("nothing" if t >= len(self._plan)
                        else f"{self._plan[t][0][0]} {np.dtype(self._plan[t][0][1]).name}")
                self._leave(f"request {t} asked for {got}, the plan has {want}")
            elif not all(h.dead() for h in self._dies_at.get(t, ())):
                self._leave(f"an array the plan reuses at request {t} is still held")
            else:
                held = self._plan[t][1]
                if held is not None:
                    self.served += 1
                    return held.array
        return None

    def lend(self, arr) -> None:
        """``arr`` (or a view of it) goes to another thread, which lets go of it by the step's end, at a time no
        one can plan: recorded, it lives to the step's end (replayed, the plan says so already)."""
        if self._mode != "record" or threading.get_ident() != self._owner:
            return
        root = self._root(arr)
        for i, held in self._live:
            if self._root(held.array) is root:
                self._lent.add(i)

    def _stamp(self, t: int, end: bool = False):
        """Record: the arrays nobody holds any more die at ``t`` (a lent one only at the step's ``end``)."""
        alive = []
        for i, held in self._live:
            if (end or i not in self._lent) and held.dead():
                self._deaths[i] = t
            else:
                alive.append((i, held))
        self._live = alive

    def _make_plan(self):
        n = len(self._log)
        planned = [i for i in range(n) if self._deaths[i] is not None]
        sizes = [_nbytes(*self._log[i]) for i in planned]
        deaths = [self._deaths[i] for i in planned]
        offsets, total = plan_offsets(sizes, planned, deaths)
        self.peak_bytes = peak_bytes(sizes, planned, deaths)
        slab = self._slab(total) if total else None
        plan = [(key, None) for key in self._log]
        dies_at: dict = {}
        for i, off in zip(planned, offsets):
            shape, dtype = self._log[i]
            held = _hold(self._carve(slab, off, shape, np.dtype(dtype)), self._refs)
            plan[i] = (self._log[i], held)
            dies_at.setdefault(self._deaths[i], []).append(held)
        self._plan, self._dies_at, self._keep = plan, dies_at, slab
        self.slab_bytes, self.reason = total, ""
        self.plans += 1
        self._log, self._deaths = [], []

    @property
    def escaped(self) -> int:
        """Requests of the plan served fresh every step: arrays still held after the recorded step."""
        return sum(1 for _, held in self._plan or () if held is None)


class _Scope:
    __slots__ = ("arena",)

    def __init__(self, arena):
        self.arena = arena

    def __enter__(self):
        self.arena._enter()
        return self.arena

    def __exit__(self, kind, value, tb):
        self.arena._exit(kind is None)
        return False
