"""Tensor parallelism, Megatron-style: the collective pairs and the column- and row-parallel Linear layers.

A pair of Linear layers (the MLP's Linear → activation → Linear, the GPT's c_fc → GELU →
c_proj and c_attn → attention → c_proj) is split over the ``tp`` ranks of the mesh's
``tp_comm``: the first by output features (column parallel: each rank computes its
slice of the features), the second by input features (row parallel: each rank's
partial product, summed). One Allreduce in the forward pass, one in the backward pass:

    x (replicated) ─ copy ─▶ column-parallel ─▶ activation ─▶ row-parallel ─ reduce ─▶ y (replicated)

* ``CopyToTensorParallel``: forward identity, backward Allreduce of the input gradient;
* ``ReduceFromTensorParallel``: forward Allreduce of the partial outputs, backward identity.

(Megatron-core's ``copy_to_tensor_model_parallel_region`` and
``reduce_from_tensor_model_parallel_region``.) Collective: every rank of a tensor-parallel
group runs the same layers on the same (replicated) input, so each calls these in the
same order, in the forward and in the backward pass alike.

What a rank keeps of each full tensor is its ``shard`` kind (``SHARD_KINDS``); the full
tensor is initialised from the seed and the shard cut from it, so every layout starts
from the single-process model, and checkpoints reassemble the full tensors
(parallel/sharding.py).
"""

from __future__ import annotations

import numpy as np

from ..nn.layers import Linear

__all__ = ["TensorParallel", "CopyToTensorParallel", "ReduceFromTensorParallel", "ColumnParallelLinear",
           "RowParallelLinear", "shard", "unshard", "SHARD_KINDS"]

# how a full tensor is cut across the T ranks; rank r keeps piece r
SHARD_KINDS = ("rows", "rows3", "cols")  # rows3: q, k, v blocks of rows, each cut (attention heads stay whole)


def shard(full: np.ndarray, kind: str, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s piece of ``full`` (a contiguous copy)."""
    if kind == "rows":
        return np.ascontiguousarray(np.split(full, size, axis=0)[rank])
    if kind == "cols":
        return np.ascontiguousarray(np.split(full, size, axis=1)[rank])
    if kind == "rows3":
        return np.ascontiguousarray(np.concatenate([np.split(g, size, axis=0)[rank] for g in np.split(full, 3)]))
    raise ValueError(kind)


def unshard(pieces: list[np.ndarray], kind: str) -> np.ndarray:
    """The full tensor from every rank's piece, in rank order (the inverse of ``shard``)."""
    if kind == "rows":
        return np.concatenate(pieces, axis=0)
    if kind == "cols":
        return np.concatenate(pieces, axis=1)
    if kind == "rows3":
        groups = [np.split(p, 3) for p in pieces]
        return np.concatenate([np.concatenate([g[i] for g in groups]) for i in range(3)])
    raise ValueError(kind)


class TensorParallel:
    """A rank's tensor-parallel group: ``size``, ``rank``, and in-place Allreduce of backend arrays.

    ``allreduce_`` sums over ``comm`` (the mesh's ``tp_comm``) through ``transport`` (device arrays
    straight to a CUDA-aware MPI, else staged through host memory) and counts the bytes.
    """

    def __init__(self, comm, transport):
        self.comm, self.transport = comm, transport
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.bytes = 0  # sent by this rank's tensor-parallel Allreduces, as the payload counts it

    def allreduce_(self, arr) -> None:
        self.transport.allreduce_(self.comm, arr)
        self.bytes += int(arr.nbytes)


class CopyToTensorParallel:
    """Identity forward; Allreduce backward: the replicated input's gradient is the sum of the ranks' parts.

    ``backward`` is collective over the tensor-parallel group: every rank of it calls it, for the same
    layer and micro-batch, in the same order."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def forward(self, be, x):
        return x

    def backward(self, be, dx):
        self.tp.allreduce_(dx)
        return dx


class ReduceFromTensorParallel:
    """Allreduce forward (the partial products' sum); identity backward: every rank has the whole gradient.

    ``forward`` is collective over the tensor-parallel group: every rank of it calls it, for the same
    layer and micro-batch, in the same order (training and evaluation alike)."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def forward(self, be, y):
        self.tp.allreduce_(y)
        return y

    def backward(self, be, dy):
        return dy


class ColumnParallelLinear(Linear):
    """This rank's slice of a Linear's output features: weight (out/T, in) and bias (out/T).

    ``groups = 3`` for a fused q/k/v projection: each of its three row blocks is cut separately,
    so a rank keeps whole heads of q, k and v (``shard`` kind ``rows3``).
    """

    def __init__(self, full: Linear, tp: TensorParallel, groups: int = 1):
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


class RowParallelLinear(Linear):
    """This rank's slice of a Linear's input features: weight (out, in/T); the bias (out) is replicated.

    The partial products are summed over the group (``ReduceFromTensorParallel``); tensor-parallel
    rank 0 adds the bias to its partial before the sum, so it is added once.
    """

    def __init__(self, full: Linear, tp: TensorParallel):
        super().__init__(full.in_features // tp.size, full.out_features, full.has_bias)
        self.full, self.tp, self.reduce = full, tp, ReduceFromTensorParallel(tp)
        self.shards = {"weight": "cols"}

    def forward(self, be, x):
        out = be.empty((x.shape[0], self.out_features))
        be.matmul_nt(x, self.w["weight"], out, bias=self.w.get("bias") if self.tp.rank == 0 else None)
        return self.reduce.forward(be, out), x

    def backward(self, be, dout, x, accumulate=False, need_dinp=True):
        return super().backward(be, self.reduce.backward(be, dout), x, accumulate=accumulate, need_dinp=need_dinp)
