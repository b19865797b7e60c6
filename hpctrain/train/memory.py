"""What each rank of a running job holds: the planner's figures (hpctrain/plan.py), filled from live buffers.

After the first step and at the end of ``run()`` every rank describes itself as a ``RankMemory``: its
parameter, gradient and optimizer bytes from the same function the planner uses (so the two agree by
construction on the model state), the saved-activation peak the stage executor measured, the
communication buffers it really allocated, and the process's peak RSS (``getrusage``), which is what
``/usr/bin/time -f %M`` reports. World rank 0 gathers them into one metrics line::

    {"step": 1, "memory": [{"rank": 0, "stage": 0, ..., "total_bytes": ..., "peak_rss_bytes": ...}, ...]}

Collective over the world communicator.
"""

from __future__ import annotations

import resource
import sys

import numpy as np

from ..parallel.executor import nbytes_of
from ..parallel.zero3 import ParamGather
from ..plan import RUNTIME_BYTES, RankMemory, background_saves, checkpoint_bytes, state_bytes

__all__ = ["rank_memory", "gather_memory", "peak_rss_bytes"]

FIELDS = ("rank", "stage", "dp_rank", "tp_rank", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes",
          "buffer_bytes", "runtime_bytes")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def rank_memory(t, activation_bytes: int) -> RankMemory:
    """This rank's RankMemory from the Trainer ``t``'s live state (``activation_bytes``: the executor's peak)."""
    cfg, mesh = t.cfg, t.mesh
    state = state_bytes(part_size=t.part.layout.size, owned_size=t.part.owned_size, shard=t.shard, zero=t.zero,
                        released=t.grad_memory is not None, slots=len(t.optim.slots),
                        bucket_elems=t.run_plan.bucket_elems, micro_batches=t.run_plan.micro_batches,
                        gather_bytes=ParamGather.pool_bytes(t.part) if t.state.gather is not None else 0)
    state["optimizer_bytes"] = t.optim.slot_bytes  # what the slots really hold
    buffers = nbytes_of([getattr(t.sync, "_scatter_out", None), t.sync.host,  # None: not allocated
                         t.sync.wire.packed if t.sync.wire is not None else None])
    tree_host = getattr(t.sync, "_tree_host", None)  # the deterministic tree's own staging, where not t.sync.host
    if tree_host is not None and tree_host is not t.sync.host:
        buffers += nbytes_of([tree_host])
    if t.sync.tree is not None:  # train.deterministic: the shard tree's parked sums and the tree's receive buffer
        buffers += t.sync.tree.parked_bytes + nbytes_of([getattr(t.sync, "_tree_in", None)])
    for ring in t.runner.executor.rings():
        buffers += nbytes_of([ring.arrays, ring.hosts])
    if cfg.checkpoint.dir:  # a background save's snapshot of this rank's pieces (on a device, a host copy too)
        buffers += checkpoint_bytes(t.part, t.shard, dp_rank=mesh.dp_rank, slots=len(t.optim.slots),
                                    background=background_saves(cfg), device=t.be.is_device)
    return RankMemory(rank=mesh.rank, stage=mesh.pp_rank, dp_rank=mesh.dp_rank, tp_rank=mesh.tp_rank,
                      activation_bytes=int(activation_bytes), buffer_bytes=buffers,
                      runtime_bytes=RUNTIME_BYTES["gpt" if cfg.model.kind == "gpt" else "mlp"], **state)


def gather_memory(comm, mine: RankMemory) -> list[dict] | None:
    """Every rank's figures and peak RSS on rank 0 of ``comm`` (None elsewhere; collective)."""
    row = np.array([getattr(mine, f) for f in FIELDS] + [peak_rss_bytes()], dtype=np.int64)
    rows = np.empty((comm.Get_size(), row.size), dtype=np.int64) if comm.Get_rank() == 0 else None
    comm.Gather(row, rows, root=0)
    if rows is None:
        return None
    out = []
    for r in rows:
        m = RankMemory(**{f: int(v) for f, v in zip(FIELDS, r[:-1])})
        out.append({**m.as_dict(), "peak_rss_bytes": int(r[-1])})
    return out


def summary(records: list[dict]) -> str:
    """One log line: the rank with the highest peak RSS, its tracked figures in MB (KB below a megabyte: a small
    model's parameters are not "0 MB")."""
    top = max(records, key=lambda m: m["peak_rss_bytes"])
    mb = lambda key: size_text(top[key])  # noqa: E731
    return (f"memory: peak RSS {mb('peak_rss_bytes')} on rank {top['rank']} (largest of {len(records)}); it holds "
            f"params {mb('params_bytes')}, grads {mb('grads_bytes')}, optimizer {mb('optimizer_bytes')}, activations "
            f"{mb('activation_bytes')}, buffers {mb('buffer_bytes')} + runtime ~{mb('runtime_bytes')} "
            f"= {mb('total_bytes')} (hpctrain plan's fields)")


def size_text(n: int) -> str:
    """Bytes as MB (decimal, as the plan prints them), or KB below a megabyte; 0 as "0 B"."""
    if n >= 1e6:
        return f"{n / 1e6:,.0f} MB"
    return f"{n / 1e3:,.1f} KB" if n else "0 B"
