"""A device backend over host arrays, for CI: the CUDA backend's device-only calls (pinned staging, events, the
copy streams, ``upload``, ``read_host``) and its wait counting, with the CPU backend's kernels.

    from fake_device import FakeDevice
    startup.get_backend = lambda *a, **k: FakeDevice()    # what a Trainer then runs on

Its arrays are numpy arrays that MPI can read as they are, so ``parallel.cuda_aware = true`` takes the path a
CUDA-aware MPI takes on a GPU (device memory handed to MPI after the right waits), which the simulator cannot
(simulated arrays have no device pointer); ``false`` takes the staged path. Every copy is immediate, so this
checks the call sequence and the counts, not the GPU's asynchrony: results are the CPU backend's bits.
"""

import numpy as np

from hpctrain.backend.base import Mark, StreamWaits
from hpctrain.backend.cpu import CpuBackend


class FakeDevice(StreamWaits, CpuBackend):
    name = "fake-device"
    is_device = True

    def __init__(self, clock: bool = False):
        super().__init__()
        self._init_waits()  # the CUDA backend's own bookkeeping of waits and marks (backend/base.py)
        self.clock = 0.0 if clock else None  # timer(): a fake GPU clock, one second per event

    def synchronize(self):
        self._stream_wait(lambda: None)

    def to_host(self, arr):
        self.synchronize()
        return np.array(arr)

    def read_host(self, *arrays):
        if arrays:
            self.synchronize()
        return [np.array(a) for a in arrays]

    def upload(self, host):
        return np.array(host)

    def pinned_host(self, shape, dtype=np.float32):
        return np.empty(shape, dtype=dtype)

    def to_host_into(self, dev, host):
        host[...] = dev
        self.synchronize()

    def from_host_into(self, host, dev):
        dev[...] = host
        self.synchronize()

    def mark(self):
        return self._new_mark(None)

    def after(self, mark):
        pass

    def timer(self):
        if self.clock is None:
            return None
        self.clock += 1.0
        return self.clock

    def elapsed(self, start, end):
        return end - start

    def host_wait_for(self, mark):
        if not self.passed(mark):
            self._count_wait(whole_stream=False)

    def stage_out(self, dev, host, ready):
        host[...] = dev
        self._count_wait()

    def stage_in(self, host, dev):
        dev[...] = host
        return Mark(None, None)
