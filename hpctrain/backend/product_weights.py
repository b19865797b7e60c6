"""``train.precision = "bf16"``: a part's parameters held rounded to bfloat16 for the products that read them.

Without it every product rounds its weight anew: a Linear's W twice a micro-batch (X·Wᵀ forward, dY·W backward,
once more under recompute), as a bf16 GEMM on a float32 weight must. With it the part's whole flat parameter
buffer is rounded into one bfloat16 copy (half its bytes, held across steps) before each micro-batch's forward,
and inside the part's forward and backward a product whose operand is a weight of that buffer reads the copy's
view of it instead (PyTorch's autocast caches its casts of the weights for a forward the same way; llm.c keeps its
parameters in bf16 beside the float32 master). The values are the ones the product would have rounded to, so no
bit changes; the parameters cannot change between a micro-batch's forward and its backward (the optimizer runs
after the step's last backward), so the copy made at the forward serves the backward too.

``ProductWeights`` is the mixin of both bf16 backends (cpu/precision.py, cuda/precision.py); each says how to
make the copy, round into it and find an array's address. nn/model.py's ``ModelPart`` opens the scope
(``product_weights``) around its forward and backward passes, refreshing at the forward of its first chunk;
outside a scope, or for a part whose parameters are gathered per unit (ZeRO-3), every product rounds as before.
``hpctrain plan`` counts the copy among the parameters.
"""

from __future__ import annotations

import contextlib

import numpy as np

__all__ = ["ProductWeights"]


class _Held:
    """The flat float32 parameters ``data``, their bfloat16 copy, and the copy's views by (address, shape)."""

    def __init__(self, data, copy, lo: int):
        self.data, self.copy, self.lo, self.hi, self.views = data, copy, lo, lo + 4 * data.size, {}


class ProductWeights:
    """The bf16 backends' held copy of a part's parameters (this module's docstring). A backend supplies
    ``_bf16_copy(n)`` (a new array of n bfloat16 values), ``_round_into(data, copy)``, ``_address(x)`` and
    ``_contiguous(x)``."""

    _held = None  # the _Held of the last part that opened a scope
    _scopes = 0  # scopes open: products read the copy only inside one

    @contextlib.contextmanager
    def product_weights(self, data, refresh: bool):
        """Inside: a product reading a weight of ``data`` (a part's flat float32 parameters) reads its bfloat16
        copy. ``refresh``: round ``data`` into the copy first (a forward; the backward's scope reads the copy its
        micro-batch's forward made). A copy is made for a new ``data``, and rounded then whatever ``refresh``."""
        held = self._held
        if held is None or held.data is not data:
            held = self._held = _Held(data, self._bf16_copy(data.size), self._address(data))
            refresh = True
        if refresh and data.size:
            self._round_into(data, held.copy)
        self._scopes += 1
        try:
            yield
        finally:
            self._scopes -= 1

    def _held_weight(self, x):
        """The copy's view of ``x`` where a scope is open and ``x`` is a C-contiguous float32 view into the held
        parameters (a weight as a layer binds it), else None."""
        held = self._held
        if not self._scopes or held is None or x is None or x.dtype != np.float32 or not x.size:
            return None
        lo = self._address(x)
        if not held.lo <= lo < held.hi:
            return None
        key = (lo, tuple(x.shape))
        view = held.views.get(key)
        if view is None:
            if not self._contiguous(x):
                return None
            start = (lo - held.lo) // 4
            view = held.views[key] = held.copy[start : start + x.size].reshape(x.shape)
        return view
