"""A Chrome/Perfetto trace of the step: one track per rank, spans for every instruction.

    [train] trace = "runs/pp2/trace.json"      # open in https://ui.perfetto.dev or chrome://tracing

Each rank records ``(kind, micro-batch, step, start, duration)`` rows in memory while it
trains; at the end of the run the rows go to world rank 0 with one ``Gatherv`` and rank 0
writes the JSON. Times are measured from a common start taken after a ``Barrier``, so
the tracks line up to within the barrier's skew. Writing is collective over the mesh.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from .._files import replaced_atomically
from ..errors import ConfigError

__all__ = ["Tracer", "KINDS"]

KINDS = ("load", "forward", "backward", "send activation", "recv activation", "send grad", "recv grad", "allreduce",
         "optimizer")
MAX_SPANS = 2_000_000  # over all ranks (rank 0 writes them all: about 0.3 GB of JSON); later ones are counted


class Tracer:
    """Collects this rank's spans; ``write(path)`` is collective over ``mesh.world``."""

    def __init__(self, mesh):
        self.mesh = mesh
        mesh.world.Barrier()  # a common time origin for every track
        self.origin = time.perf_counter()
        self.step = 0
        self.rows = []
        self.limit = max(10_000, MAX_SPANS // mesh.size)  # this rank's share
        self.dropped = 0

    def span(self, kind: str, mb: int, t0: float, t1: float) -> None:
        if len(self.rows) >= self.limit:
            self.dropped += 1
            return
        self.rows.append((KINDS.index(kind), mb, self.step, t0 - self.origin, t1 - t0))

    def write(self, path: str) -> int:
        """Gather every rank's spans to rank 0 and write the trace there; returns the number of spans written."""
        from mpi4py import MPI

        comm = self.mesh.world
        local = np.array(self.rows, dtype=np.float64).reshape(-1, 5)
        counts = np.zeros(comm.Get_size(), dtype=np.int64)
        comm.Allgather(np.array([local.size], dtype=np.int64), counts)
        where = np.array([self.mesh.pp_rank, self.mesh.dp_rank, self.mesh.tp_rank], dtype=np.int64)
        places = np.zeros((comm.Get_size(), 3), dtype=np.int64)
        comm.Allgather(where, places)
        if comm.Get_rank() != 0:
            comm.Gatherv(local, None, root=0)
            return 0
        rows = np.empty(int(counts.sum()), dtype=np.float64)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        comm.Gatherv(local, [rows, counts, displs, MPI.DOUBLE], root=0)
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                   "args": {"name": f"rank {r} (stage {p}, dp {d}, tp {t})"}} for r, (p, d, t) in enumerate(places)]
        events += [{"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}}
                   for r in range(len(places))]
        for r in range(comm.Get_size()):
            block = rows[displs[r] : displs[r] + counts[r]].reshape(-1, 5)
            for kind, mb, step, start, dur in block:
                name = KINDS[int(kind)]
                args = {"step": int(step)}
                if mb >= 0:
                    args["micro_batch"] = int(mb)
                    name = f"{name} {int(mb)}"
                events.append({"name": name, "cat": KINDS[int(kind)], "ph": "X", "pid": 0, "tid": r,
                               "ts": round(start * 1e6, 3), "dur": round(dur * 1e6, 3), "args": args})
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        except OSError as e:
            raise ConfigError(f"train.trace: cannot write {path}: {e.strerror or e}") from None
        # a temporary beside it, made exclusively under a name nobody can guess, then renamed (_files.py); a full
        # disk or a folder gone read-only is one line and leaves nothing behind
        with replaced_atomically(path, f"train.trace: cannot write {path}", ConfigError) as tmp, open(tmp, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"spans_dropped_on_rank_0": self.dropped}}, f)
        return len(events)
