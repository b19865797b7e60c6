"""The column- and row-parallel Linear layers of tensor parallelism (Megatron-style), beside the other layers.

A pair of Linear layers is split over the ``tp`` ranks of a tensor-parallel group: the first by
output features (``ColumnParallelLinear``), the second by input features (``RowParallelLinear``),
one Allreduce forward and one backward, through the collective pairs of parallel/tensor.py:

    x (replicated) ─ copy ─▶ column-parallel ─▶ activation ─▶ row-parallel ─ reduce ─▶ y (replicated)

``tp`` is the group a part is built for (parallel/tensor.py's ``TensorParallel``: ``rank``, ``size``,
``allreduce_``), passed in, never looked up. Collective: every rank of the group runs the same layers
in the same order, in the forward and in the backward pass alike.
"""

from __future__ import annotations

from ..parallel.tensor import CopyToTensorParallel, ReduceFromTensorParallel
from .layers import Linear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


class ColumnParallelLinear(Linear):
    """This rank's slice of a Linear's output features: weight (out/T, in) and bias (out/T).

    ``groups = 3`` for a fused q/k/v projection: each of its three row blocks is cut separately,
    so a rank keeps whole heads of q, k and v (``shard`` kind ``rows3``).
    """

    def __init__(self, full: Linear, tp, groups: int = 1):
        out = full.out_features // tp.size
        super().__init__(full.in_features, out, full.has_bias)
        self.full, self.copy = full, CopyToTensorParallel(tp)
        kind = "rows3" if groups == 3 else "rows"
        self.shards = {"weight": kind, **({"bias": kind} if full.has_bias else {})}

    def forward(self, be, x):
        return super().forward(be, self.copy.forward(be, x))

    def backward(self, be, dout, x, accumulate=False, need_dinp=True):
        dinp = super().backward(be, dout, x, accumulate=accumulate, need_dinp=need_dinp)
        return None if dinp is None else self.copy.backward(be, dinp)

    def backward_input(self, be, dout, x, accumulate=False, need_dinp=True):
        dinp, wsaved = super().backward_input(be, dout, x, accumulate=accumulate, need_dinp=need_dinp)
        return (None if dinp is None else self.copy.backward(be, dinp)), wsaved


class RowParallelLinear(Linear):
    """This rank's slice of a Linear's input features: weight (out, in/T); the bias (out) is replicated.

    The partial products are summed over the group (``ReduceFromTensorParallel``); tensor-parallel
    rank 0 adds the bias to its partial before the sum, so it is added once.
    """

    def __init__(self, full: Linear, tp):
        super().__init__(full.in_features // tp.size, full.out_features, full.has_bias)
        self.full, self.tp, self.reduce = full, tp, ReduceFromTensorParallel(tp)
        self.shards = {"weight": "cols"}

    def forward(self, be, x):
        x = be.product_input(x)
        out = be.empty((x.shape[0], self.out_features))
        be.matmul_nt(x, self.w["weight"], out, bias=self.w.get("bias") if self.tp.rank == 0 else None)
        return self.reduce.forward(be, out), x

    def backward(self, be, dout, x, accumulate=False, need_dinp=True):
        return super().backward(be, self.reduce.backward(be, dout), x, accumulate=accumulate, need_dinp=need_dinp)

    def backward_input(self, be, dout, x, accumulate=False, need_dinp=True):
        return super().backward_input(be, self.reduce.backward(be, dout), x, accumulate=accumulate,
                                      need_dinp=need_dinp)
