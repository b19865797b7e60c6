"""The step graphs' bookkeeping (hpctrain/backend/cuda/graphs.py) with stand-in kernels: what is recorded, cut,
replayed, and run one by one when a step leaves its segments. Every launch is accounted for exactly once and in
order, whatever the step does; the CUDA backend's own runs under the simulator are tests/cuda/test_cuda_graphs.py."""

import threading

import pytest

from hpctrain.backend.cuda.graphs import CannotReplay, StepGraphs


class Kernel:
    def __init__(self, name):
        def py_func():
            pass
        py_func.__name__ = self.__name__ = name  # what launch.kernel_name reads
        self.py_func = py_func


A, B, C = Kernel("a"), Kernel("b"), Kernel("c")


class Stream:
    """What reaches the device, in order: ('direct', name, arg), ('graph', [names]) and the host's actions."""

    def __init__(self, limit=64, build_fails=False):
        self.log = []
        self.graphs = StepGraphs(freeze=self.freeze, run=self.run, build=self.build, limit=limit)
        self.build_fails = build_fails

    def freeze(self, kernel, grid, block, args):
        if kernel is C:
            raise CannotReplay("numba's path")
        return kernel.__name__, args[0]

    def run(self, frozen):
        self.log.append(("direct",) + frozen)

    def build(self, frozen):
        if self.build_fails:
            raise RuntimeError("no graphs here")
        stream = self

        class Graph:
            def launch(self):
                stream.log.append(("graph", list(frozen)))
        return Graph()

    def launch(self, kernel, arg):
        if not self.graphs.launch(kernel, 1, 32, (arg,)):
            self.log.append(("direct", kernel.__name__, arg))

    def host(self, what):
        self.graphs.boundary()
        self.log.append(("host", what))

    def step(self, body, planned=True):
        self.log = []
        self.graphs.enter(planned)
        body(self)
        self.graphs.exit(True, planned)
        return self.log


def plain(s):  # two segments around an upload, the second cut by the limit when it is 2
    s.launch(A, 1)
    s.host("upload")
    s.launch(B, 2)
    s.launch(A, 3)
    s.launch(B, 4)
    s.host("read")


def test_a_step_is_recorded_then_replayed_as_one_launch_per_segment():
    s = Stream()
    first = s.step(plain)
    assert first == [("direct", "a", 1), ("host", "upload"), ("direct", "b", 2), ("direct", "a", 3),
                     ("direct", "b", 4), ("host", "read")]
    assert s.graphs.segments == 2 and s.graphs.captures == 1
    again = s.step(plain)
    assert again == [("graph", [("a", 1)]), ("host", "upload"), ("graph", [("b", 2), ("a", 3), ("b", 4)]),
                     ("host", "read")]
    assert s.graphs.graph_launches == 2 and s.graphs.reason == ""


def test_segments_are_cut_every_limit_launches_and_launched_as_soon_as_they_are_matched():
    s = Stream(limit=2)
    s.step(plain)
    assert s.graphs.segments == 3
    assert s.step(plain) == [("graph", [("a", 1)]), ("host", "upload"), ("graph", [("b", 2), ("a", 3)]),
                             ("graph", [("b", 4)]), ("host", "read")]


def test_a_different_launch_runs_the_matched_ones_then_goes_on_one_by_one_and_the_next_step_records():
    s = Stream()
    s.step(plain)

    def changed(s):
        s.launch(A, 1)
        s.host("upload")
        s.launch(B, 2)
        s.launch(A, 99)  # another address
        s.launch(B, 4)
        s.host("read")

    assert s.step(changed) == [("graph", [("a", 1)]), ("host", "upload"), ("direct", "b", 2), ("direct", "a", 99),
                               ("direct", "b", 4), ("host", "read")]
    assert "launch 1 of segment 1 is a with other arguments" in s.graphs.reason
    assert s.graphs.segments == 0
    assert s.step(changed)[2] == ("direct", "b", 2)  # recorded again
    assert s.step(changed)[2] == ("graph", [("b", 2), ("a", 99), ("b", 4)])


def test_the_host_acting_inside_a_segment_queues_what_was_matched_first():
    s = Stream()
    s.step(plain)

    def early(s):
        s.launch(A, 1)
        s.host("upload")
        s.launch(B, 2)
        s.host("read")  # before the segment's other two launches
        s.launch(A, 3)
        s.launch(B, 4)

    assert s.step(early) == [("graph", [("a", 1)]), ("host", "upload"), ("direct", "b", 2), ("host", "read"),
                             ("direct", "a", 3), ("direct", "b", 4)]
    assert "the host acted on the stream after launch 1 of segment 1" in s.graphs.reason


@pytest.mark.parametrize("short", [1, 2])
def test_a_step_that_ends_early_loses_nothing(short):
    s = Stream()
    s.step(plain)

    def body(s):
        s.launch(A, 1)
        s.host("upload")
        if short == 2:
            s.launch(B, 2)

    log = s.step(body)
    assert log == [("graph", [("a", 1)]), ("host", "upload")] + ([("direct", "b", 2)] if short == 2 else [])
    assert s.graphs.segments == 0
    assert ("ended inside" if short == 2 else "1 of the recorded 2 segments") in s.graphs.reason


def test_a_step_the_arena_does_not_serve_from_its_plan_neither_records_nor_replays():
    s = Stream()
    assert s.step(plain, planned=False)[0] == ("direct", "a", 1) and s.graphs.segments == 0
    s.step(plain)
    s.graphs.enter(True)
    s.log = []
    s.launch(A, 1)
    s.graphs.leave("the arena left its plan: request 3")  # a fresh array: other addresses from here
    s.launch(B, 2)
    s.graphs.exit(True, False)
    assert s.log == [("graph", [("a", 1)]), ("direct", "b", 2)] and s.graphs.segments == 0
    assert s.graphs.reason == "the arena left its plan: request 3"


def test_a_kernel_no_graph_can_hold_turns_graphs_off_for_good():
    s = Stream()

    def with_c(s):
        s.launch(A, 1)
        s.launch(C, 2)

    s.step(with_c)
    assert s.graphs.off.startswith("c cannot be replayed: numba's path")
    assert s.step(with_c) == [("direct", "a", 1), ("direct", "c", 2)]
    assert s.step(with_c) == [("direct", "a", 1), ("direct", "c", 2)] and s.graphs.graph_launches == 0


def test_a_graph_that_cannot_be_built_turns_graphs_off():
    s = Stream(build_fails=True)
    s.step(plain)
    assert "building a graph failed (RuntimeError: no graphs here)" == s.graphs.off
    assert s.step(plain)[0] == ("direct", "a", 1)


def test_other_threads_launch_directly():
    s = Stream()
    s.step(plain)
    s.graphs.enter(True)
    s.log = []
    s.launch(A, 1)
    t = threading.Thread(target=lambda: (s.launch(B, 7), s.graphs.boundary()))
    t.start()
    t.join()
    s.host("upload")
    s.graphs.exit(True, True)
    assert s.log == [("graph", [("a", 1)]), ("direct", "b", 7), ("host", "upload")]
    assert s.graphs.segments == 0  # the step made one of two segments: recorded again next time


def test_a_failed_step_records_nothing():
    s = Stream()
    s.graphs.enter(True)
    s.launch(A, 1)
    s.graphs.exit(False, True)
    assert s.graphs.segments == 0 and s.graphs.captures == 0
