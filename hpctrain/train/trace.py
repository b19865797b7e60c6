"""A Chrome/Perfetto trace of the step: one track per rank, spans for every instruction.

    [train] trace = "runs/pp2/trace.json"      # open in https://ui.perfetto.dev or chrome://tracing

Each rank records ``(kind, micro-batch, step, start, duration)`` rows in memory while it
trains, up to its share of one budget for the whole run (``MAX_SPANS`` spans over all
ranks: later spans are counted, not kept). At the end of the run world rank 0 writes
the JSON as a stream: its own track, then each other rank's, received one rank at a
time (``Recv``) and written event by event, so rank 0 holds one rank's rows at most,
whatever the number of ranks. Times are measured from a common start taken after a
``Barrier``, so the tracks line up to within the barrier's skew. Writing is collective
over the mesh.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from .._files import replaced_atomically
from ..errors import ConfigError

__all__ = ["Tracer", "KINDS", "MAX_SPANS"]

KINDS = ("load", "forward", "backward", "send activation", "recv activation", "send grad", "recv grad", "allreduce",
         "optimizer", "backward input", "backward weight")  # the last two: zero-bubble's split backward
MAX_SPANS = 2_000_000  # per run, over all ranks (about 0.3 GB of JSON); each rank keeps its share
_TAG = 7301  # the tracks' point-to-point messages to rank 0


class Tracer:
    """Collects this rank's spans; ``write(path)`` is collective over ``mesh.world``."""

    def __init__(self, mesh):
        self.mesh = mesh
        mesh.world.Barrier()  # a common time origin for every track
        self.origin = time.perf_counter()
        self.step = 0
        self.rows = []
        self.limit = max(1, MAX_SPANS // mesh.size)  # this rank's share of the run's budget
        self.dropped = 0
        self.evaluating = False  # spans of an evaluation pass: named "eval ...", category "evaluation"

    def span(self, kind: str, mb: int, t0: float, t1: float, chunk: int = 0) -> None:
        """One span of ``kind`` (micro-batch ``mb``, -1 for none; ``chunk``: interleaved 1F1B's model chunk)."""
        if len(self.rows) >= self.limit:
            self.dropped += 1
            return
        kind_index = KINDS.index(kind) + (len(KINDS) if self.evaluating else 0)  # one float column for both
        self.rows.append((kind_index, mb, chunk, self.step, t0 - self.origin, t1 - t0))

    def write(self, path: str) -> int:
        """Stream every rank's spans to a trace file written on rank 0; returns the number of events written there
        (0 elsewhere). Every other rank sends its rows to rank 0, which receives them one rank at a time, even when
        its file cannot be written (then a ConfigError once all are in), so no rank is left in a send."""
        comm = self.mesh.world
        local = np.array(self.rows, dtype=np.float64).reshape(-1, 6)
        head = np.array([local.shape[0], self.dropped, self.mesh.pp_rank, self.mesh.dp_rank, self.mesh.tp_rank],
                        dtype=np.int64)
        heads = np.empty((comm.Get_size(), 5), dtype=np.int64) if comm.Get_rank() == 0 else None
        comm.Gather(head, heads, root=0)
        if comm.Get_rank() != 0:
            comm.Send(local, dest=0, tag=_TAG)
            return 0

        def tracks():
            yield 0, local
            for r in range(1, comm.Get_size()):
                rows = np.empty((int(heads[r, 0]), 6), dtype=np.float64)
                comm.Recv(rows, source=r, tag=_TAG)
                yield r, rows

        blocks = tracks()
        try:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            except OSError as e:
                raise ConfigError(f"train.trace: cannot write {path}: {e.strerror or e}") from None
            # a temporary beside it, made exclusively under a name nobody can guess, then renamed (_files.py); a
            # full disk or a folder gone read-only is one line and leaves nothing behind
            with replaced_atomically(path, f"train.trace: cannot write {path}", ConfigError) as tmp, \
                    open(tmp, "w") as f:
                return _write_events(f, heads, blocks)
        finally:
            for _ in blocks:  # whatever happened to the file: every rank's send is received
                pass


def _write_events(f, heads, blocks) -> int:
    """The trace JSON, one event a line: the track names, then each rank's spans as ``blocks`` yields them."""
    f.write('{"displayTimeUnit": "ms", "otherData": {"spans_dropped": %d}, "traceEvents": [\n'
            % int(heads[:, 1].sum()))
    n = 0

    def put(event):
        nonlocal n
        f.write((",\n" if n else "") + json.dumps(event))
        n += 1

    for r, (_, _, p, d, t) in enumerate(heads):
        put({"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
             "args": {"name": f"rank {r} (stage {p}, dp {d}, tp {t})"}})
        put({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for r, rows in blocks:
        for kind, mb, chunk, step, start, dur in rows:
            evaluation, kind = divmod(int(kind), len(KINDS))
            name = KINDS[kind]
            args = {"step": int(step)}
            if mb >= 0:
                args["micro_batch"] = int(mb)
                name = f"{name} {int(mb)}"
            if chunk > 0:  # interleaved 1F1B: which of the stage's model chunks
                args["chunk"] = int(chunk)
                name = f"{name} chunk {int(chunk)}"
            if evaluation:  # the validation pass after training step "step", not part of it
                args["evaluation"] = True
                name = f"eval {name}"
            put({"name": name, "cat": "evaluation" if evaluation else KINDS[kind], "ph": "X", "pid": 0, "tid": r,
                 "ts": round(start * 1e6, 3), "dur": round(dur * 1e6, 3), "args": args})
    f.write("\n]}\n")
    return n
