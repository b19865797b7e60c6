"""Dropout's mask as a counter-based draw: whether an element is dropped is a pure function of a 64-bit site key
and the element's global index, so every layout, every recompute and both backends draw the same mask, and a
backward pass redraws it instead of storing it (Philox-style, as torch's CUDA dropout draws from (seed, offset)).

    key  = site_key(seed, step, site)               one per step and dropout site (host Python ints)
    bits = mix64(key ^ (index >> 1))                 splitmix64's finaliser: a bijection of 64-bit words,
    draw = bits >> 32 if index is even else bits & (2³² − 1)   one hash for two neighbouring elements
    keep = draw >= threshold(p)                      threshold = floor(p · 2³²): P(drop) = p to 2⁻³²
    out  = x · (1 / (1 − p) if keep else 0)          inverted dropout, torch's scaling (NaN stays NaN)

An element's ``index`` is its place in a global array the layout never changes: rows ``grow`` of ``W`` columns,
``index = grow · W + c``, where a backend's row r of a (R, W) array is ``grow = row0 + (r // group) · stride +
r % group`` (``DropRows``): for a (B·T, C) activation of a micro-batch, ``row0 = sample0 · T`` and one group
(the sample's place in the step's global batch, so data parallel and micro-batches change nothing); for
attention's probabilities [B, H, T, T] on a tensor-parallel rank holding heads [h0, h0 + H) of ``n_head``,
groups of H·T rows, ``stride = n_head · T`` and ``row0 = (sample0 · n_head + h0) · T``; ``causal`` then
says the elements above each T × T block's diagonal (c > r mod W) are zero probabilities: out = 0 there, no draw.

``keep_reference`` is the numpy definition both backends are tested against bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["DropRows", "site_key", "mix64", "threshold", "keep_scale", "keep_reference", "dropout_reference"]

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MUL1, MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(z: int) -> int:
    """splitmix64's output function of a Python int (mod 2⁶⁴)."""
    z = (z + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MUL1) & MASK64
    z = ((z ^ (z >> 27)) * MUL2) & MASK64
    return z ^ (z >> 31)


def site_key(seed: int, step: int, site: int) -> int:
    """The 64-bit key of dropout site ``site`` at global step ``step`` of a run seeded ``seed``."""
    return mix64(mix64(mix64(seed & MASK64) ^ (step & MASK64)) ^ (site & MASK64))


def threshold(p: float) -> int:
    """Drop an element when its draw's top 32 bits are below this (p in [0, 1))."""
    return min(int(p * 2**32), 2**32 - 1)


def keep_scale(p: float) -> np.float32:
    return np.float32(1.0 / (1.0 - p))


class DropRows(NamedTuple):
    """One dropout draw over a backend's (R, W) array: its probability, site key and rows' global places."""

    p: float
    key: int
    row0: int = 0
    group: int = 0  # 0: one group, the whole array
    stride: int = 0
    causal: bool = False  # square blocks of attention probabilities: nothing drawn above the diagonal
    # what ``key`` is site_key of, when known (seed -1: a key given as it is): a device backend derives the key in
    # its kernel from the step in device memory, so the launch is the same every step (issue 49 item 2)
    seed: int = -1
    step: int = 0
    site: int = 0

    def from_row(self, r0: int) -> "DropRows":
        """The draw over rows r0, r0 + 1, .. of the array, as an array of its own: the rows must lie in one group
        (the flash attention's chunk of one sample's heads), and r0 start a T × T block when ``causal``."""
        group = self.group or 0
        row0 = self.row0 + ((r0 // group) * (self.stride or group) + r0 % group if group else r0)
        return self._replace(row0=row0, group=0, stride=0)

    def global_rows(self, R: int) -> np.ndarray:
        r = np.arange(R, dtype=np.int64)
        group = self.group or max(R, 1)
        return self.row0 + (r // group) * (self.stride or group) + r % group


def keep_reference(rows: DropRows, R: int, W: int) -> np.ndarray:
    """The (R, W) keep mask, in numpy's wrapping uint64 arithmetic (causal: False above the diagonals)."""
    index = (rows.global_rows(R)[:, None] * W + np.arange(W, dtype=np.int64)[None, :]).astype(np.uint64)
    z = np.uint64(rows.key) ^ (index >> np.uint64(1))
    with np.errstate(over="ignore"):
        z = z + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MUL1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MUL2)
    z = z ^ (z >> np.uint64(31))
    draw = np.where(index & np.uint64(1), z & np.uint64(0xFFFFFFFF), z >> np.uint64(32))
    keep = draw >= np.uint64(threshold(rows.p))
    if rows.causal:
        keep &= np.arange(W)[None, :] <= (np.arange(R) % W)[:, None]
    return keep


def dropout_reference(x: np.ndarray, rows: DropRows) -> np.ndarray:
    """out = x · (1 / (1 − p) where kept, else 0), float32 as the backends compute it."""
    R, W = x.shape
    factor = np.where(keep_reference(rows, R, W), keep_scale(rows.p), np.float32(0.0)).astype(np.float32)
    out = (x * factor).astype(np.float32)
    if rows.causal:  # above the diagonals: 0 itself, not x · 0
        out[np.arange(W)[None, :] > (np.arange(R) % W)[:, None]] = 0.0
    return out
