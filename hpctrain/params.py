"""Flat parameter, gradient and optimizer-state buffers with named views.

A model's parameters live in one contiguous float32 buffer, in forward order
(``"0.weight"``, ``"0.bias"``, ``"2.weight"``, ...); gradients live in a second
buffer with the same layout, and each optimizer slot in another. Layers see
named views into them, so gradient buckets are plain slices of the gradient
buffer and the optimizer step is one kernel over the whole buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ParamSpec", "ParamLayout", "FlatBuffer"]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.size


class ParamLayout:
    """Names, shapes and offsets of every parameter in the flat buffer."""

    def __init__(self, named_shapes):
        specs, offset = [], 0
        seen = set()
        for name, shape in named_shapes:
            if name in seen:
                raise ValueError(f"duplicate parameter name {name!r}")
            seen.add(name)
            spec = ParamSpec(name, tuple(int(s) for s in shape), offset)
            specs.append(spec)
            offset = spec.end
        self.specs: tuple[ParamSpec, ...] = tuple(specs)
        self.size = offset
        self._by_name = {s.name: s for s in specs}

    def __iter__(self):
        return iter(self.specs)

    def __len__(self):
        return len(self.specs)

    def __getitem__(self, name) -> ParamSpec:
        return self._by_name[name]

    def __contains__(self, name) -> bool:
        return name in self._by_name

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def describe(self) -> str:
        """One line per parameter: ``name shape offset``; what ranks hash and compare."""
        return "\n".join(f"{s.name} {'x'.join(map(str, s.shape))} {s.offset}" for s in self.specs)

    def pack(self, arrays: dict[str, np.ndarray] | None) -> np.ndarray:
        """Named arrays -> one flat float32 host array in this layout (zeros when ``arrays`` is None)."""
        host = np.zeros(self.size, dtype=np.float32)
        if arrays is not None:
            for s in self.specs:
                host[s.offset : s.end] = np.asarray(arrays[s.name], dtype=np.float32).reshape(-1)
        return host

    def unpack(self, host: np.ndarray) -> dict[str, np.ndarray]:
        """One flat host array in this layout -> named views of it (no copies)."""
        return {s.name: host[s.offset : s.end].reshape(s.shape) for s in self.specs}

    def first_difference(self, other_description: str) -> str:
        """Say where another rank's ``describe()`` first differs from this one."""
        mine = self.describe().splitlines()
        theirs = other_description.splitlines()
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return f"parameter #{i}: {a!r} here, {b!r} there"
        return f"{len(mine)} parameters here, {len(theirs)} there"


class FlatBuffer:
    """One backend array of ``layout.size`` float32 values with a named view per parameter."""

    def __init__(self, backend, layout: ParamLayout, *, zero: bool = True, data=None):
        """``data``: an array of ``layout.size`` float32 to use as the buffer (zero = 2's releasable host memory)."""
        self.backend = backend
        self.layout = layout
        if data is not None and tuple(data.shape) != (layout.size,):
            raise ValueError(f"data of shape {tuple(data.shape)} for a layout of {layout.size} values")
        self.data = data if data is not None else backend.zeros((layout.size,)) if zero else backend.empty((layout.size,))
        self._views = {s.name: self.data[s.offset : s.end].reshape(s.shape) for s in layout}

    def __getitem__(self, name):
        return self._views[name]

    def items(self):
        return self._views.items()

    def to_host_dict(self) -> dict[str, np.ndarray]:
        host = self.backend.to_host(self.data)
        return {s.name: np.array(host[s.offset : s.end].reshape(s.shape)) for s in self.layout}

    def load_host_dict(self, arrays: dict[str, np.ndarray]) -> None:
        self.backend.copy_(self.data, self.backend.asarray(self.layout.pack(arrays)))
