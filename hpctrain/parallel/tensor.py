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

What a rank keeps of each full tensor is its ``shard`` kind (hpctrain/shards.py); the full
tensor is initialised from the seed and the shard cut from it, so every layout starts
from the single-process model, and checkpoints reassemble the full tensors
(parallel/sharding.py).
"""

from __future__ import annotations

import numpy as np

__all__ = ["TensorParallel", "CopyToTensorParallel", "ReduceFromTensorParallel"]

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
