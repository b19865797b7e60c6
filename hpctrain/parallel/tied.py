"""Tensors two pipeline stages hold in common: the GPT's token embedding and the head tied to it.

The first stage owns ``transformer.wte.weight``; the last holds a replica for its head
(nn/model.py: ``ModelPart.shared``). Both live on the mesh's ``ends_comm`` (the first and
last stage of one data-parallel/tensor-parallel position, COMM_NULL on the stages between),
where the first stage is rank 0. As in Megatron, the replica starts equal to the owner
(``broadcast_tied``) and the two sum their gradients after the data-parallel reduction
(``sum_tied_grads``); the owner alone then updates the tensor, with its optimizer state, and
sends the new values to the replica (``refresh_replicas``), which holds no optimizer state.

Collective over ``ends_comm``: both ends call these with the same ``part.shared`` names (the
same order on both, by construction); a stage between them has none and calls nothing.

A part whose owner and tying layer sit on one stage has a local replica only under
``train.deterministic`` (``part.local_ties``, nn/model.py: ``split_ties``): the same three steps
run in place on that rank, with no communication.
"""

from __future__ import annotations

__all__ = ["broadcast_tied", "sum_tied_grads", "refresh_replicas"]


def broadcast_tied(mesh, part, local) -> None:
    """The owner's values of each shared tensor into the replica, in the host array ``local`` (part layout)."""
    for name in part.shared:
        spec = part.layout[name]
        mesh.ends_comm.Bcast(local[spec.offset : spec.end], root=0)
    for owner, replica in part.local_ties:
        a, b = part.layout[owner], part.layout[replica]
        local[b.offset : b.end] = local[a.offset : a.end]


def sum_tied_grads(mesh, transport, part, grads) -> None:
    """Sum each shared tensor's gradient over the two ends, in place in ``grads`` (a FlatBuffer)."""
    for name in part.shared:
        transport.allreduce_(mesh.ends_comm, grads[name])
    for owner, replica in part.local_ties:  # the replica's gradient is not read again: the owner's alone
        transport.backend.add_(grads[owner], grads[replica])


def refresh_replicas(mesh, transport, part, params) -> None:
    """The owner's updated values of each shared tensor into the replica (``Bcast`` over ``ends_comm`` from the
    first stage; ``params``: a FlatBuffer), after the optimizer step."""
    for name in part.shared:
        arr = params[name]
        buf = transport.collective_buffer(arr)  # the array itself (host, or CUDA-aware MPI), or a pinned copy
        mesh.ends_comm.Bcast(buf, root=0)
        transport.collective_done(buf, arr)
    for owner, replica in part.local_ties:
        transport.backend.copy_(params[replica], params[owner])
