"""A training step replayed: its arrays from the step arena (backend/arena.py), and once the arena replays, its
kernels from the step's graphs (graphs.py). ``StepReplay`` is the CudaBackend mixin that builds both and gives
them what they need from the backend: the arena its slab and the arrays carved from it, the graphs the frozen
launches and the places where the host acts on the stream (``_host_acts``, called by every copy, event and
wait of the backend)."""

from __future__ import annotations

import contextlib
import math

import numpy as np
from numba import cuda

from ...errors import BackendError
from ..arena import StepArena
from .graphs import Emulated, StepGraphs, freeze_simulated, run_simulated
from .memory import arena_refs, memory_root, slab_array


class StepReplay:
    """The arena and graphs part of CudaBackend (``arena``, ``graphs``: None where off)."""

    def _init_replay(self, arena: bool, graphs) -> None:
        # a training step's arrays replayed from one planned slab (backend/arena.py; cuda.arena = false: off)
        self.arena = None if not arena else StepArena(
            fresh=self._fresh, slab=self._slab, carve=self._carve, refs=arena_refs, root=memory_root)
        if graphs is True and not arena:
            raise BackendError("cuda.graphs = true needs cuda.arena = true: a graph replays the addresses the "
                               "arena keeps the same from step to step")
        self.graphs = self._step_graphs() if arena and graphs is not False else None

    def _slab(self, nbytes):
        """The arena's one allocation (uninitialised; under the simulator every byte 0xFF, float NaN, so a kernel
        that read memory it never wrote would show in the tests' bits)."""
        if self._pool is None:
            return memoryview(np.full(nbytes, 0xFF, dtype=np.uint8))
        # the recorded step's arrays went back to the pool, and the slab replaces them: give those blocks back to
        # the driver, so the device holds the step's memory once, not twice
        self._pool.release_cached()
        return self._pool.alloc((nbytes,), np.uint8)

    def _carve(self, slab, offset, shape, dtype):
        if self._pool is None:
            n = math.prod(shape) * dtype.itemsize
            return cuda.simulator.cudadrv.devicearray.FakeCUDAArray(
                np.ndarray(shape, dtype, buffer=slab[offset : offset + n]), stream=self.stream)
        return slab_array(slab, offset, shape, dtype)

    def lend(self, arr) -> None:
        if self.arena is not None:
            self.arena.lend(arr)

    def step_scope(self):
        """Around a training step: its arrays come from the step arena (backend/arena.py), and once the arena
        replays, its kernels from the step's graphs (graphs.py)."""
        if self.arena is None:
            return contextlib.nullcontext()
        return self._step()

    @contextlib.contextmanager
    def _step(self):
        graphs, ok = self.graphs, False
        with self.arena.step() as arena:
            if graphs is not None:
                graphs.enter(planned=arena.replaying)
            try:
                yield
                ok = True
            finally:
                if graphs is not None:
                    graphs.exit(ok, planned=arena.replaying)

    def _step_graphs(self):
        if self.simulator:
            return StepGraphs(freeze=freeze_simulated, run=self._run_frozen,
                              build=lambda frozen: Emulated(frozen, self.stream))
        if self.launcher is None:  # HPCTRAIN_CUDA_LAUNCH=numba: every launch through numba's path
            graphs = StepGraphs(freeze=None, run=None, build=None)
            graphs.off = "HPCTRAIN_CUDA_LAUNCH=numba launches every kernel through numba's path"
            return graphs
        return StepGraphs(freeze=self.launcher.freeze, run=self._run_frozen, build=self.launcher.build_graph)

    def _run_frozen(self, frozen):
        """A launch the graphs recorded, run on its own (a step that left its graphs): counted in ``launches``."""
        self.launches += 1
        if self.simulator:
            run_simulated(frozen, self.stream)
        else:
            self.launcher.run_frozen(frozen)

    def _host_acts(self):
        """The host is about to queue a copy or an event on the stream, or wait for it: the graphs' segments end
        here (graphs.py), and kernels they still hold are queued first."""
        if self.graphs is not None:
            self.graphs.boundary()
