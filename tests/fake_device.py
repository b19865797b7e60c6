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
from hpctrain.backend.cuda.vmm import ReleasableDevice


class FakeVmm:
    """CUDA's virtual memory calls (backend/cuda/vmm.py's VmmDriver) over one host array: every map fills its unit
    with NaN, as if the memory mapped there held anything, so a read of released gradients, or of a unit filled
    but not written before it is read, spreads NaN into the result. It checks the calls' rules: no map over a
    mapping, no unmap or access of nothing, no release of a mapped handle, no write into an empty unit (on a GPU
    they all share one spare unit: checked as a unit leaves the spare); ``inaccessible`` counts mapped units
    never given access. ``unit``: bytes (16 float32 by default)."""

    def __init__(self, unit: int = 64):
        self.unit = unit
        self.memory = None
        self.base = 1 << 20  # a made-up device address
        self.mapped = {}  # address -> handle
        self.handles = set()  # created, not released
        self.accessible = set()  # mapped addresses given access
        self.spare = None  # the buffer's spare unit's handle, once built (``releasable_buffer`` below)
        self._next = 0

    def reserve(self, size):
        assert self.memory is None, "one reservation"
        self.memory = np.zeros(size // 4, dtype=np.float32)
        return self.base

    def free(self, va, size):
        assert va == self.base and not self.mapped

    def create(self):
        self._next += 1
        self.handles.add(self._next)
        return self._next

    def map(self, va, handle):
        assert va not in self.mapped and handle in self.handles, (va, handle)
        self.mapped[va] = handle
        at = (va - self.base) // 4
        self.memory[at : at + self.unit // 4] = np.nan

    def _units(self, va, size):
        assert size > 0 and size % self.unit == 0, size
        return range(va, va + size, self.unit)

    def access(self, va, size):
        for at in self._units(va, size):
            assert at in self.mapped, at
            self.accessible.add(at)

    def unmap(self, va, size):
        for at in self._units(va, size):
            assert at in self.mapped, at
            if self.mapped[at] == self.spare:  # an empty unit: no gradient was written into it while it was one
                x = self.memory[(at - self.base) // 4 : (at - self.base + self.unit) // 4]
                assert (np.isnan(x) | (x == 0)).all(), f"unit at {at} was written while empty (the shared spare)"
            del self.mapped[at]
            self.accessible.discard(at)

    def inaccessible(self):
        """Mapped units without access: a missed ``access`` (a kernel touching them would fault)."""
        return len(set(self.mapped) - self.accessible)

    def release(self, handle):
        assert handle in self.handles and handle not in self.mapped.values(), handle
        self.handles.discard(handle)

    def wrap(self, address, n, owner):
        at = (address - self.base) // 4
        return self.memory[at : at + n]


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

    release_unsupported = ""  # zero = 2 releases gradient memory, through FakeVmm

    def releasable_buffer(self, n, *, outside, keep_bytes):
        self.vmm = FakeVmm()
        buf = ReleasableDevice(n, outside=outside, keep_bytes=keep_bytes, driver=self.vmm, wrap=self.vmm.wrap)
        self.vmm.spare = buf._spare
        self.fill_(buf.array, 0)
        return buf
