"""ZeRO-2's gradient buffer on the host: pages outside this rank's chunks leave once reduced, and some of them
wait for the next layer to write gradients instead of being faulted in again.

    grads = ReleasableHost(n, outside=shard.outside(), keep_bytes=shard.keep_bytes())   # train/startup.py
    grads.fill(lo, hi)      # the training thread, before a layer writes its gradients in [lo, hi)
    grads.release(lo, hi)   # the communication thread, once [lo, hi) (outside this rank's chunk) is reduced

A page handed back with ``madvise(MADV_DONTNEED)`` is faulted in again, zero-filled, by the next write: on the
2-core VM of docs/performance.md 17-19 ms per 100 MB against 8 ms for resident pages, 76-129 ms once the
hypervisor had taken the freed pages back (free page reporting). So released pages move instead:

* the buffer is cut into units: a transparent huge page (2 MiB) for buffers of 16 huge pages and more, else
  about 1/256 of the buffer in whole pages; its end lies on a unit boundary, as do the bucket and chunk cuts
  of a large buffer (parallel/zero.py, ``page_unit``), so nothing outside a chunk shares a unit with it;
* a unit wholly outside this rank's chunks is *live* from ``fill`` (a layer is about to write it) until
  ``release`` (its bucket is reduced), *empty* otherwise;
* ``release`` moves a live unit's pages into a pool mapping with ``mremap(MREMAP_DONTUNMAP)``: the page tables
  move, nothing is copied or zeroed, and the unit stays mapped, empty (it reads as zeros). The pool and the
  live units together stay within ``keep_bytes`` (two buckets: what hpctrain plan counts) and within the most
  units ever live at once, so memory never holds more than the buffer did before the pool; the rest go back to
  the kernel;
* ``fill`` moves pooled pages into the empty units of [lo, hi); whatever the pool lacks is faulted in. Their
  stale values are never read: an empty unit has not been written since its release (every writer calls
  ``fill`` first), and a step's first backward overwrites every gradient (``accumulate=False``).

Where ``mremap`` cannot (not Linux, a kernel before 5.7, no libc) or a move fails, the pool is off for the rest
of the run and released pages go back to the kernel. A failed move may have unmapped its destination, so that
range is mapped again (empty) at once. MPI libraries that cache memory registrations (UCX, libfabric) learn of
these moves through the same hooks on libc's ``mremap`` and ``madvise`` that cover releasing pages at all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading

import numpy as np

from ..backend.releasable import EMPTY, LIVE, ReleasableUnits

__all__ = ["ReleasableHost", "merged_ranges", "unit_bytes"]

_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4


def _huge_page_bytes() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def unit_bytes(nbytes: int, page: int = mmap.PAGESIZE, huge: int | None = None) -> int:
    """How many bytes of a buffer of ``nbytes`` move or leave at a time: a huge page for large buffers (a move
    keeps it whole), else about 1/256 of the buffer in whole pages (at most 256 mappings to keep apart)."""
    huge = huge or _huge_page_bytes()
    if nbytes >= 16 * huge:
        return huge
    per = -(-nbytes // 256)
    return max(page, -(-per // page) * page)


class _Libc:
    """libc's ``mremap`` and ``mmap`` (``ok`` False where there is none)."""

    def __init__(self):
        self.ok = False
        if not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            self.mremap, self.mmap = libc.mremap, libc.mmap
        except (OSError, AttributeError):
            return
        self.mremap.restype = self.mmap.restype = ctypes.c_void_p
        self.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
        self.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)
        self.ok = True

    def move(self, src: int, dst: int, size: int) -> bool:
        """The pages of [src, src + size) to [dst, dst + size), which must hold nothing; src stays mapped."""
        got = self.mremap(src, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, dst)
        return got == dst

    def map_empty(self, addr: int, size: int) -> None:
        """[addr, addr + size) mapped again as fresh anonymous memory (a failed move may have unmapped it)."""
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED
        self.mmap(addr, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)


def _aligned_map(nbytes: int, unit: int):
    """An anonymous private mapping of at least ``nbytes`` from a ``unit``-aligned address: (mmap, that address,
    its offset in the mmap)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    size = nbytes + unit
    m = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    start = np.frombuffer(m, dtype=np.uint8).ctypes.data
    offset = (-start) % unit
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        # transparent huge pages where the kernel allows them: whatever is faulted in comes 2 MiB at a time
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return m, start + offset, offset


class ReleasableHost(ReleasableUnits):
    """A zeroed float32 host array whose pages outside ``outside`` can leave memory (Linux ``MADV_DONTNEED``),
    up to ``keep_bytes`` of them kept aside for the next ``fill``.

    ``outside``: the [lo, hi) element ranges that ``release`` will be given (the rest of each bucket beyond this
    rank's chunk). Where ``madvise`` is missing the array is plain memory and ``release`` does nothing.
    ``moved_in``: units ``fill`` gave pooled pages, over the buffer's life.
    """

    def __init__(self, n: int, *, outside=(), keep_bytes: int = 0):
        # n, unit, _pad (the array ends on a unit boundary), _state, _live, _peak (backend/releasable.py)
        nbytes = self._init_units(n, unit_bytes(max(1, int(n)) * 4), outside)
        self._map, self._origin, offset = _aligned_map(self._pad + nbytes, self.unit)
        self._offset = offset + self._pad  # the array's start in the mmap
        self.array = np.frombuffer(self._map, dtype=np.float32, count=self.n, offset=self._offset)
        self.releasable = hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED")
        self._lock = threading.Lock()  # fill (training thread) and release (communication thread)
        self.moved_in = 0
        self._libc = _Libc()
        slots = keep_bytes // self.unit
        self._pool = None
        if self.releasable and self._libc.ok and slots >= 1 and (self._state == EMPTY).any():
            self._pool_map, base, _ = _aligned_map(slots * self.unit, self.unit)
            self._pool = {"free": [base + i * self.unit for i in range(slots)], "full": [], "slots": slots}

    @property
    def keep_bytes(self) -> int:
        """How many bytes of released pages may wait for the next backward (0: the pool is off)."""
        return self._pool["slots"] * self.unit if self._pool else 0

    @property
    def pooled_bytes(self) -> int:
        """Released pages waiting in the pool for the next backward."""
        return len(self._pool["full"]) * self.unit if self._pool else 0

    def _addr(self, u: int) -> int:
        return self._origin + u * self.unit

    def _pool_off(self) -> None:
        """A move failed: no pool from now on, and what it held goes back to the kernel."""
        self._pool = None
        try:
            self._pool_map.madvise(mmap.MADV_DONTNEED)
        except OSError:  # whatever stays is at most keep_bytes, and goes with the buffer
            pass

    def release(self, lo: int, hi: int) -> int:
        """Elements [lo, hi) leave memory: their live whole units to the pool while it has room, the rest of the
        whole pages inside back to the kernel; returns the bytes released."""
        if not self.releasable or hi <= lo:
            return 0
        page = mmap.PAGESIZE
        start = -(-(self._pad + lo * 4) // page) * page  # from the first unit's start, as the units are
        end = (self._pad + hi * 4) // page * page
        if end <= start:
            return 0
        with self._lock:
            back = []  # [a, b) byte ranges (from the first unit's start) for the kernel
            u0, u1 = -(-start // self.unit), end // self.unit
            if u0 >= u1:
                back.append((start, end))
            else:
                back += [(start, u0 * self.unit), (u1 * self.unit, end)]
                for u in range(u0, u1):
                    if self._state[u] == LIVE:
                        self._go_empty(u)
                        if self._to_pool(u):
                            continue
                    back.append((u * self.unit, (u + 1) * self.unit))
            for a, b in merged_ranges(back):
                self._map.madvise(mmap.MADV_DONTNEED, self._offset - self._pad + a, b - a)
        return end - start

    def _to_pool(self, u: int) -> bool:
        """Unit u's pages into a free pool slot, if the pool and the live units stay within the limit and within
        the most units ever live at once (what memory held before the pool: it never raises that peak)."""
        pool = self._pool
        if pool is None or not pool["free"] or len(pool["full"]) + 1 + self._live > min(pool["slots"], self._peak):
            return False
        slot = pool["free"].pop()
        if not self._libc.move(self._addr(u), slot, self.unit):
            self._libc.map_empty(slot, self.unit)
            self._pool_off()
            return False
        pool["full"].append(slot)
        return True

    def fill(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) are about to be written: their empty units become live and get pooled pages while
        there are some. An empty unit has not been written since its release (every writer calls this first),
        so whatever those pages held is overwritten before anything reads it."""
        if not self.needs(lo, hi):  # release() never changes a unit being written
            return
        with self._lock:
            for u in self._empty_touched(lo, hi):
                u = int(u)
                self._go_live(u)
                pool = self._pool
                if pool is None or not pool["full"]:
                    continue
                slot = pool["full"].pop()
                if self._libc.move(slot, self._addr(u), self.unit):
                    pool["free"].append(slot)
                    self.moved_in += 1
                else:
                    self._libc.map_empty(self._addr(u), self.unit)
                    self._pool_off()


def merged_ranges(ranges):
    """Adjacent or overlapping [a, b) ranges joined, empty ones dropped, in order."""
    out = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
