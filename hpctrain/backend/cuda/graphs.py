"""A training step's kernels replayed in segments, each one CUDA graph (issue 49 item 3).

Once the step arena (backend/arena.py) replays a step, every kernel of the step sees the same arrays, the same
addresses and (with the per-step values on the device) the same scalars as the step before: two steps' launch
traces are equal. ``StepGraphs`` turns that into fewer launches from the host:

1. **Record.** The first step the arena replays is run as always, one launch at a time, and each launch is
   noted twice: as a *key* (kernel, grid, block and its arguments as a graph would freeze them:
   ``launch.traced_arguments``) and *frozen* (what it takes to launch it again without its Python objects: the
   kernel's handle and flat parameters on a GPU, the arrays' addresses under the simulator). The launches are
   cut into **segments** wherever the host acts on the stream (a copy, an event, a wait: the backend calls
   ``boundary()``), and every ``limit`` launches, so that the GPU starts on a segment while the host goes through
   the next. After the step each segment becomes one graph (``build``).
2. **Replay.** Later steps run the same Python code, but each launch is only compared with the next recorded
   key: nothing is launched until a segment's last launch matches, and then the whole segment is, as one graph
   launch. Where the host acts between segments (an upload, a gradient bucket's event for the communication
   thread, the step's one read of its loss and norm) it acts exactly where it did when recorded.
3. **Leaving.** A launch that differs from the recorded one, the host acting inside a segment, a step that
   ends early or the arena leaving its plan: the launches of the segment matched so far run one by one (in
   order, on the same stream, so nothing is lost or reordered), the rest of the step launches as before, and
   the next planned step records again. ``reason`` says why. Values are never wrong, only not replayed.

A cuBLASLt product (gemm/__init__.py) is recorded as a launch too, its frozen form the call bound to its operands'
addresses: a graph captures it (the library's kernels enqueued on the builder's capturing stream), so a step with
cuBLASLt products replays in as few segments as one without.

Under the CUDA simulator a "graph" is an emulation (``Emulated``): the frozen launches run in order at the
segment's launch, on arrays rebuilt from the recorded addresses (a real graph holds addresses too, not
objects). So the simulator runs the same bookkeeping, and a host action the backend forgot to mark as a
boundary shows there as wrong bits: the kernels before it would not have run yet.

Only the thread inside the step is recorded or replayed; other threads' launches go straight to the stream.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from .launch import kernel_name, traced_arguments

__all__ = ["StepGraphs", "Emulated", "CannotReplay", "freeze_simulated", "SEGMENT_LAUNCHES"]

SEGMENT_LAUNCHES = 64  # the most kernels in one segment: the GPU runs one while the host matches the next


class CannotReplay(Exception):
    """A launch no graph can hold, for good (a kernel numba's own path must launch)."""


class _Segment:
    __slots__ = ("keys", "frozen", "graph")

    def __init__(self):
        self.keys, self.frozen, self.graph = [], [], None


class StepGraphs:
    """The step's segments, recorded once and replayed after (above). The backend gives it:

    ``freeze(kernel, grid, block, args)``: the launch frozen, None where it cannot be yet (its first call, still
    numba's) or raising CannotReplay where it never can; ``run(frozen)``: launch one frozen launch now (counted
    as a launch from Python); ``build(frozen_list)``: an object whose ``launch()`` queues them all as one graph.
    """

    def __init__(self, *, freeze, run, build, limit: int = SEGMENT_LAUNCHES):
        self._freeze, self._run, self._build, self.limit = freeze, run, build, int(limit)
        self._segments = None  # the recorded step: a list of _Segment, each with its graph
        self._mode = None  # inside a step: "record", "replay", or "direct" (left or not planned)
        self._owner = None
        self._si = self._li = 0  # replay: the segment and the launch in it that come next
        self._current = None  # record: the open segment
        self._recorded = None  # record: the closed ones
        self.off = ""  # why graphs are off for good ("" while they may be used)
        self.reason = ""  # why the last step that could replay did not (or recorded again)
        self.graph_launches = 0  # segments launched as graphs, in all
        self.captures = 0  # steps recorded into graphs

    @property
    def replaying(self) -> bool:
        return self._mode == "replay"

    @property
    def segments(self) -> int:
        return len(self._segments or ())

    # ------------------------------------------------------------------ the step

    def enter(self, planned: bool) -> None:
        """A step begins; ``planned``: the arena serves it from its plan (the addresses of the recorded step)."""
        self._owner, self._si, self._li = threading.get_ident(), 0, 0
        if self.off or not planned:
            self._segments, self._mode = None, "direct"
        elif self._segments is not None:
            self._mode = "replay"
        else:
            self._mode, self._current, self._recorded = "record", _Segment(), []

    def exit(self, ok: bool, planned: bool) -> None:
        """The step ends (``ok``: without an exception; ``planned``: the arena kept its plan to the end)."""
        if self._mode == "replay":
            if self._li:
                self._leave("the step ended inside a recorded segment")
            elif self._si != len(self._segments):
                self.reason = f"the step made {self._si} of the recorded {len(self._segments)} segments"
                self._segments = None
            if not planned:
                self._segments = None
        elif self._mode == "record":
            self._close()
            recorded, self._recorded, self._current = self._recorded, None, None
            if ok and planned:
                self._make(recorded)
        self._mode = self._owner = None

    def _make(self, segments) -> None:
        try:
            for seg in segments:
                seg.graph = self._build(seg.frozen)
        except Exception as e:  # an older driver or cuda.core without graphs: launches one by one from now on
            self.off = f"building a graph failed ({type(e).__name__}: {e})"
            return
        self._segments, self.reason = segments, ""
        self.captures += 1

    # ------------------------------------------------------------------ launches and host actions

    def launch(self, kernel, grid, block, args, frozen=None) -> bool:
        """The backend's launch, on the thread that owns the step: True when the graphs take it (replay: it runs
        with its segment), False when the backend launches it itself now. ``frozen``: the launch already in its
        frozen form, for a library call rather than a kernel (a cuBLASLt product bound to its addresses, whose
        ``run(stream)`` enqueues it: gemm/cublaslt.py's BoundCall), keyed by ``kernel`` and ``args`` alike."""
        mode = self._mode
        if mode is None or mode == "direct" or threading.get_ident() != self._owner:
            return False
        key = (kernel, grid, block, traced_arguments(args))
        if mode == "replay":
            segments = self._segments
            if self._si < len(segments):
                seg = segments[self._si]
                if seg.keys[self._li] == key:
                    self._li += 1
                    if self._li == len(seg.keys):
                        seg.graph.launch()
                        self.graph_launches += 1
                        self._si, self._li = self._si + 1, 0
                    return True
                want = kernel_name(seg.keys[self._li][0])
                self._leave(f"launch {self._li} of segment {self._si} is {kernel_name(kernel)} with other "
                            f"arguments than the recorded {want}")
            else:
                self._leave(f"the step launched {kernel_name(kernel)} after the recorded segments")
            return False
        try:  # record
            frozen = self._freeze(kernel, grid, block, args) if frozen is None else frozen
        except CannotReplay as e:
            self.off = f"{kernel_name(kernel)} cannot be replayed: {e}"
            self._mode, self._recorded, self._current = "direct", None, None
            return False
        if frozen is None:
            self.reason = f"{kernel_name(kernel)} was launched for the first time in the recorded step"
            self._mode, self._recorded, self._current = "direct", None, None
            return False
        self._current.keys.append(key)
        self._current.frozen.append(frozen)
        if len(self._current.keys) >= self.limit:
            self._close()
        return False

    def boundary(self) -> None:
        """The host is about to act on the stream (a copy, an event, a wait): what came before must be queued."""
        if self._mode is None or threading.get_ident() != self._owner:
            return
        if self._mode == "record":
            self._close()
        elif self._mode == "replay" and self._li:
            self._leave(f"the host acted on the stream after launch {self._li} of segment {self._si}")

    def leave(self, why: str) -> None:
        """Stop replaying this step (the arena left its plan): the matched launches run now."""
        if self._mode == "replay" and threading.get_ident() == self._owner:
            self._leave(why)
        elif self._mode == "record" and threading.get_ident() == self._owner:
            self.reason, self._mode, self._recorded, self._current = why, "direct", None, None

    def _leave(self, why: str) -> None:
        seg = self._segments[self._si] if self._si < len(self._segments) else None
        for frozen in (seg.frozen[: self._li] if seg is not None else ()):
            self._run(frozen)
        self.reason, self._segments, self._mode, self._li = why, None, "direct", 0

    def _close(self) -> None:
        if self._current is not None and self._current.keys:
            self._recorded.append(self._current)
            self._current = _Segment()


# ---------------------------------------------------------------------- the simulator's emulation


class _SimArray:
    """A simulated device array as a graph would hold it: its memory's address, shape, strides and dtype."""

    __slots__ = ("address", "shape", "strides", "dtype")

    def __init__(self, ary):
        self.address = ary.__array_interface__["data"][0]
        self.shape, self.strides, self.dtype = ary.shape, ary.strides, ary.dtype

    def thaw(self, stream):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        extent = self.dtype.itemsize + sum((n - 1) * s for n, s in zip(self.shape, self.strides) if n)
        memory = (ctypes.c_char * max(extent, 1)).from_address(self.address)
        ary = np.ndarray(self.shape, self.dtype, buffer=memory, strides=self.strides)
        return FakeCUDAArray(ary, stream=stream)


def _freeze_args(args):
    out = []
    for a in args:
        if isinstance(a, tuple):
            out.append(tuple(_freeze_args(a)))
        elif hasattr(a, "_ary"):
            out.append(_SimArray(a._ary))
        elif isinstance(a, np.ndarray):  # a host array (numba copies it over at each launch): the GPU's refuses it
            raise CannotReplay("a host array argument, copied at each launch")
        else:
            out.append(a)
    return out


def _thaw_args(frozen, stream):
    out = []
    for a in frozen:
        if isinstance(a, tuple):
            out.append(tuple(_thaw_args(a, stream)))
        elif isinstance(a, _SimArray):
            out.append(a.thaw(stream))
        else:
            out.append(a)
    return out


def freeze_simulated(kernel, grid, block, args):
    """A simulator launch frozen: the kernel, its shape and its arrays' addresses (no array object kept)."""
    return kernel, grid, block, _freeze_args(args)


def run_simulated(frozen, stream) -> None:
    if hasattr(frozen, "run"):  # a library call (a cuBLASLt product), bound to its addresses
        frozen.run(stream)
        return
    kernel, grid, block, args = frozen
    kernel[grid, block, stream](*_thaw_args(args, stream))


class Emulated:
    """A segment as the simulator replays it: its frozen launches in order, when the segment is launched."""

    def __init__(self, frozen, stream):
        self.frozen, self.stream = list(frozen), stream

    def launch(self) -> None:
        for f in self.frozen:
            run_simulated(f, self.stream)
