"""Tensor parallelism, Megatron-style: the group, the collective pairs, and how tensors are cut.

A pair of Linear layers (the MLP's Linear → activation → Linear, the GPT's c_fc → GELU →
c_proj and c_attn → attention → c_proj) is split over the ``tp`` ranks of the mesh's
``tp_comm``: the first by output features (column parallel: each rank computes its
slice of the features), the second by input features (row parallel: each rank's
partial product, summed). One Allreduce in the forward pass, one in the backward pass:

    x (replicated) ─ copy ─▶ column-parallel ─▶ activation ─▶ row-parallel ─ reduce ─▶ y (replicated)

* ``CopyToTensorParallel``: forward identity, backward Allreduce of the input gradient;
* ``ReduceFromTensorParallel``: forward Allreduce of the partial outputs, backward identity.

(Megatron-core's ``copy_to_tensor_model_parallel_region`` and
``reduce_from_tensor_model_parallel_region``.) The layers that use them, ``ColumnParallelLinear``
and ``RowParallelLinear``, live beside the other layers (nn/tensor_parallel.py) and take the
group (``TensorParallel``, built over the mesh's ``tp_comm``) when a part is built. Collective: every rank of a tensor-parallel
group runs the same layers on the same (replicated) input, so each calls these in the
same order, in the forward and in the backward pass alike.

What a rank keeps of each full tensor is its ``shard`` kind (``SHARD_KINDS``); the full
tensor is initialised from the seed and the shard cut from it, so every layout starts
from the single-process model, and checkpoints reassemble the full tensors
(parallel/sharding.py).
"""

from __future__ import annotations

import numpy as np

__all__ = ["TensorParallel", "CopyToTensorParallel", "ReduceFromTensorParallel", "shard", "unshard", "SHARD_KINDS",
           "row_block", "shard_shape"]

# how a full tensor is cut across the T ranks; rank r keeps piece r
SHARD_KINDS = ("rows", "rows3", "cols")  # rows3: q, k, v blocks of rows, each cut (attention heads stay whole)


def row_block(rows: int, size: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of rank ``rank``'s block when ``rows`` are cut ``size`` ways as evenly as they
    go: the first ``rows % size`` ranks keep one row more (numpy's ``array_split``). Only ``rows`` may be
    uneven (a vocabulary of 50257 over 2 ranks); ``rows3`` and ``cols`` cut heads and features that the
    model checks divide."""
    base, extra = divmod(int(rows), int(size))
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def shard_shape(shape, kind: str, rank: int, size: int) -> tuple:
    """The shape of rank ``rank``'s piece of a tensor of ``shape`` (``shard``'s, without the data)."""
    shape = tuple(int(n) for n in shape)
    if kind == "rows":
        return (row_block(shape[0], size, rank)[1],) + shape[1:]
    if kind == "rows3":
        return (shape[0] // size,) + shape[1:]
    if kind == "cols":
        return (shape[0], shape[1] // size) + shape[2:]
    raise ValueError(kind)


def shard(full: np.ndarray, kind: str, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s piece of ``full`` (a contiguous copy)."""
    if kind == "rows":
        first, count = row_block(full.shape[0], size, rank)
        return np.ascontiguousarray(full[first : first + count])
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

    def allreduce_host(self, arr: np.ndarray, op) -> np.ndarray:
        """``arr`` (a host numpy array) reduced with MPI ``op`` over the group, in place; returns it."""
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, arr, op=op)
        self.bytes += int(arr.nbytes)
        return arr


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
