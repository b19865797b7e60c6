"""The trace's memory does not grow with the number of ranks: one span budget for the whole run, and rank 0
writes the tracks as a stream, one rank's rows at a time (tests/mpi/test_pipeline.py checks a real trace)."""

import io
import json
from types import SimpleNamespace

import numpy as np

from hpctrain.train import trace


class _World:
    def __init__(self, size):
        self.size = size

    def Barrier(self):
        pass


def test_the_span_budget_is_split_over_the_ranks_with_no_floor():
    for ranks in (1, 8, 1024, 4096):
        t = trace.Tracer(SimpleNamespace(world=_World(ranks), size=ranks))
        assert t.limit == trace.MAX_SPANS // ranks  # 1024 ranks: 1,953 spans each, 2 M over the run
        for i in range(t.limit + 3):
            t.span("forward", 0, float(i), float(i) + 1)
        assert len(t.rows) == t.limit and t.dropped == 3


def test_rank_0_writes_each_track_before_it_receives_the_next():
    """``_write_events`` pulls the tracks from a generator (on rank 0: one ``Recv`` per rank): each rank's spans
    are in the file before the next rank's rows are asked for, so rank 0 holds one rank's rows at a time."""
    f = io.StringIO()
    heads = np.array([[2, 0, 0, 0, 0], [1, 5, 1, 0, 0], [3, 0, 1, 0, 0]])  # spans, dropped, stage, dp, tp
    asked = []

    def tracks():
        for r, (n, *_) in enumerate(heads):
            if r:  # the previous rank's spans were written before this rank's rows exist here
                assert f.getvalue().count(f'"tid": {r - 1}, "ts"') == heads[r - 1][0]
            asked.append(r)
            yield r, np.array([[1, r, i if r == 2 else 0, 0, 0.001 * i, 0.0005] for i in range(n)])  # kind, mb,
            # chunk (rank 2: an interleaved stage's), step, start, duration

    n = trace._write_events(f, heads, tracks())
    assert asked == [0, 1, 2]
    doc = json.loads(f.getvalue())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert n == len(doc["traceEvents"]) == 6 + 6 and [e["tid"] for e in spans] == [0, 0, 1, 2, 2, 2]
    assert spans[2] == {"name": "forward 1", "cat": "forward", "ph": "X", "pid": 0, "tid": 1, "ts": 0.0,
                        "dur": 500.0, "args": {"step": 0, "micro_batch": 1}}
    assert spans[4]["name"] == "forward 2 chunk 1" and spans[4]["args"] == {"step": 0, "micro_batch": 2, "chunk": 1}
    assert doc["otherData"] == {"spans_dropped": 5}


def test_evaluation_spans_are_named_and_categorised_as_evaluation():
    """An evaluation pass runs through the same executor after a training step: its spans carry the step's number
    but are named "eval ..." with category "evaluation", so a timeline does not count them as the step's."""
    t = trace.Tracer(SimpleNamespace(world=_World(1), size=1))
    t.step = 5
    t.span("forward", 0, 1.0, 2.0)
    t.evaluating = True
    t.span("forward", 0, 3.0, 4.0)
    f = io.StringIO()
    trace._write_events(f, np.array([[2, 0, 0, 0, 0]]), iter([(0, np.array(t.rows, dtype=np.float64))]))
    train, evaluation = [e for e in json.loads(f.getvalue())["traceEvents"] if e["ph"] == "X"]
    assert (train["name"], train["cat"], train["args"]) == ("forward 0", "forward", {"step": 5, "micro_batch": 0})
    assert (evaluation["name"], evaluation["cat"], evaluation["args"]) == \
        ("eval forward 0", "evaluation", {"step": 5, "micro_batch": 0, "evaluation": True})
