"""The unit bookkeeping that zero = 2's two gradient buffers share: parallel/grad_pages.py's ReleasableHost (host
pages) and cuda/vmm.py's ReleasableDevice (device memory mapped unit by unit).

A buffer of ``n`` float32 is cut into units of ``unit`` bytes and ends on a unit boundary (``_pad`` bytes before
element 0), as the bucket and chunk cuts of a large buffer do (parallel/zero.py, ``page_unit``), so nothing
outside a chunk shares a unit with it. A unit is

* *untracked*: it holds some of this rank's chunks and keeps its memory;
* *live*: wholly outside this rank's chunks, written since ``fill`` (a layer is about to write it) and not yet
  given back by ``release`` (its bucket is reduced);
* *empty*: wholly outside, given back.

Each buffer moves memory its own way; this class only says which units are which, and counts the live ones.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ReleasableUnits", "UNTRACKED", "EMPTY", "LIVE"]

UNTRACKED, EMPTY, LIVE = -1, 0, 1  # a unit's state (int8)


class ReleasableUnits:
    """A base class: ``_init_units`` sets ``n``, ``unit``, ``_pad``, ``_state`` (one state a unit), and the live
    counts ``_live`` (now) and ``_peak`` (at most, over the buffer's life)."""

    def _init_units(self, n: int, unit: int, outside) -> int:
        """The units of ``n`` float32 in units of ``unit`` bytes, those wholly inside ``outside`` (the [lo, hi)
        element ranges that ``release`` will be given) empty; returns the buffer's bytes (at least 4)."""
        self.n, self.unit = int(n), int(unit)
        nbytes = max(1, self.n) * 4
        self._pad = (-nbytes) % self.unit  # the array ends on a unit boundary, as the buckets are cut from its end
        self._state = np.full((self._pad + nbytes) // self.unit, UNTRACKED, dtype=np.int8)
        for lo, hi in outside:
            self._state[self._units_inside(lo, hi)] = EMPTY
        self._live = self._peak = 0
        return nbytes

    @property
    def peak_live_bytes(self) -> int:
        """The most released-and-written-again bytes (live units) held at once, over the buffer's life."""
        return self._peak * self.unit

    def _units_inside(self, lo: int, hi: int) -> slice:
        """The units wholly inside elements [lo, hi)."""
        return slice(-(-(self._pad + 4 * lo) // self.unit), (self._pad + 4 * hi) // self.unit)

    def _units_touched(self, lo: int, hi: int) -> tuple[int, int]:
        """[first, stop) of the units that elements [lo, hi) touch."""
        return (self._pad + 4 * lo) // self.unit, -(-(self._pad + 4 * hi) // self.unit)

    def needs(self, lo: int, hi: int) -> bool:
        """Whether writing elements [lo, hi) would bring released units back (``fill`` has work to do)."""
        if hi <= lo:  # nothing written (a tensor of no elements)
            return False
        first, stop = self._units_touched(lo, hi)
        return bool((self._state[first:stop] == EMPTY).any())

    def _empty_touched(self, lo: int, hi: int) -> np.ndarray:
        """The empty units that elements [lo, hi) touch, in order."""
        first, stop = self._units_touched(lo, hi)
        return first + np.flatnonzero(self._state[first:stop] == EMPTY)

    def _go_live(self, u: int) -> None:
        self._state[u] = LIVE
        self._live += 1
        self._peak = max(self._peak, self._live)

    def _go_empty(self, u: int) -> None:
        """A live unit given back."""
        self._state[u] = EMPTY
        self._live -= 1
