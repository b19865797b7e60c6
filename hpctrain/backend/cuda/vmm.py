"""ZeRO-2's gradient buffer on a GPU: device memory outside this rank's chunks goes back once reduced, as
ReleasableHost does with host pages (parallel/grad_pages.py).

    grads = ReleasableDevice(n, outside=shard.outside(), keep_bytes=shard.keep_bytes(), driver=VmmDriver(dev))
    grads.fill(lo, hi)      # the training thread, before a layer's backward writes its gradients in [lo, hi)
    grads.release(lo, hi)   # the communication thread, once [lo, hi) (outside this rank's chunk) is reduced

CUDA's virtual memory management does it (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemUnmap): the buffer is
one reserved range of addresses, cut into units of the allocation granularity (2 MiB on the GPUs measured), each
unit mapped to its own physical allocation (a handle). A unit wholly outside this rank's chunks is

* *live* from ``fill`` (a layer is about to write it) until ``release`` (its bucket is reduced): its own handle;
* *empty* otherwise: mapped to one shared spare unit (so a stray read finds memory, not a fault, as an empty host
  page reads as zeros), its handle unmapped and kept in a pool for the next ``fill`` (up to ``keep_bytes``, and
  never more than were ever live at once) or released to the driver.

Units holding any of this rank's chunks stay mapped to their own handles. The buffer ends on a unit boundary, as
the bucket and chunk cuts of a large buffer do (parallel/zero.py, ``page_unit``: 2 MiB of float32), so nothing
outside a chunk shares a unit with it.

Ordering: mapping changes take effect on the host's call, not in stream order, and an unmap does not wait for
kernels still running (measured: ``bench/history/cuda_vmm_probe.py``). So ``fill`` runs before the launch of the kernels
that write the range, and ``release`` only once nothing queued reads it any more: after the bucket's reduction
has returned, its copy out to the host (staged) or MPI's own read of the device buffer (CUDA-aware) done.

Host time on an H100, one call a 2 MiB unit (``bench/history/cuda_vmm_probe.py``): cuMemUnmap 25 µs, cuMemSetAccess 30,
cuMemRelease 15, cuMemCreate 13, cuMemMap 3; one cuMemSetAccess over 4 units 17 µs. So a run of units is unmapped
and given access in one call each, and mapped unit by unit. The releases run on the communication thread, the fills
before each layer's backward launches.

``VmmDriver.open`` returns None, with the reason, where there is no such driver: the CUDA simulator, a device
without virtual memory management, no cuda-python bindings. The run then keeps the full gradient buffer and says so.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ..releasable import EMPTY, LIVE, ReleasableUnits

__all__ = ["ReleasableDevice", "VmmDriver"]

class VmmDriver:
    """The few driver calls ReleasableDevice makes, for one device (cuda-python's ``cuda.bindings.driver``).

    ``unit``: the allocation granularity in bytes. Handles are the driver's ``CUmemGenericAllocationHandle``.
    Each call makes numba's context current on the calling thread first (the communication thread calls too)."""

    def __init__(self, device_id: int):
        from cuda.bindings import driver as d
        from numba import cuda

        self._d, self._cuda = d, cuda
        self._local = threading.local()
        self._current()
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_id
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_id
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._prop, self._access = prop, access
        self.unit = int(self._ok(d.cuMemGetAllocationGranularity(
            prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

    @classmethod
    def open(cls, simulator: bool):
        """``(driver, "")`` for the current device, or ``(None, why not)``."""
        if simulator:
            return None, "the CUDA simulator has no virtual memory management"
        try:
            from cuda.bindings import driver as d
            from numba import cuda
        except ImportError as e:
            return None, f"no cuda-python driver bindings ({e})"
        try:
            dev = cuda.get_current_device().id
            attr = d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            err, supported = d.cuDeviceGetAttribute(attr, dev)
            if err != d.CUresult.CUDA_SUCCESS or not supported:
                return None, "the device does not support virtual memory management"
            return cls(dev), ""
        except Exception as e:  # a driver too old for the calls, a binding that differs
            return None, f"virtual memory management failed to start ({e})"

    def _ok(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self._d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {err}")
        return rest[0] if len(rest) == 1 else None

    def _current(self) -> None:
        if not getattr(self._local, "ready", False):
            self._cuda.current_context()  # numba pushes its primary context on a thread that has none
            self._local.ready = True

    def reserve(self, size: int) -> int:
        self._current()
        return int(self._ok(self._d.cuMemAddressReserve(size, 0, 0, 0)))

    def free(self, va: int, size: int) -> None:
        self._current()
        self._ok(self._d.cuMemAddressFree(va, size))

    def create(self):
        self._current()
        return self._ok(self._d.cuMemCreate(self.unit, self._prop, 0))

    def map(self, va: int, handle) -> None:
        """``handle`` at the unit at ``va``, not yet accessible (``access``)."""
        self._current()
        self._ok(self._d.cuMemMap(va, self.unit, 0, handle, 0))

    def access(self, va: int, size: int) -> None:
        """Read-write access for this device to [va, va + size), units mapped one by one (one call for the run:
        17 µs for 4 units against 30 µs for one on an H100)."""
        self._current()
        self._ok(self._d.cuMemSetAccess(va, size, [self._access], 1))

    def unmap(self, va: int, size: int) -> None:
        """Unmap [va, va + size), whole units each mapped on its own."""
        self._current()
        self._ok(self._d.cuMemUnmap(va, size))

    def release(self, handle) -> None:
        self._current()
        self._ok(self._d.cuMemRelease(handle))


class ReleasableDevice(ReleasableUnits):
    """``n`` float32 of device memory (``array``, a device array built by ``wrap(address, n, owner)``) whose units
    wholly inside ``outside`` can give their memory back; the interface of ReleasableHost.

    ``driver``: a VmmDriver (or a test's stand-in with the same calls). ``keep_bytes``: released units' handles
    kept for the next ``fill`` (two buckets: what hpctrain plan counts). ``mapped_bytes``: the physical memory the
    buffer holds now (handles mapped or pooled, and the spare unit)."""

    releasable = True

    def __init__(self, n: int, *, outside=(), keep_bytes: int = 0, driver, wrap):
        self._drv = driver
        self._init_units(n, driver.unit, outside)  # n, unit, _pad, _state, _live, _peak (backend/releasable.py)
        units = len(self._state)
        self._lock = threading.Lock()  # fill (training thread) and release (communication thread)
        self._handles = [None] * units
        self._pool, self._slots = [], keep_bytes // self.unit
        self.moved_in = 0
        self.driver_seconds = 0.0  # host time in the driver's calls, from both threads (bench/bench_zero2_device.py)
        self._base = driver.reserve(units * self.unit)
        self._mapped = np.zeros(units, dtype=bool)
        self._spare = None
        try:
            if (self._state == EMPTY).any():
                self._spare = driver.create()
            for u in range(units):
                if self._state[u] != EMPTY:
                    self._handles[u] = driver.create()
                driver.map(self._addr(u), self._handles[u] if self._state[u] != EMPTY else self._spare)
                self._mapped[u] = True
            driver.access(self._base, units * self.unit)
        except Exception:
            self.close()
            raise
        self.array = wrap(self._base + self._pad, self.n, self)  # the array keeps this object alive

    @property
    def keep_bytes(self) -> int:
        return self._slots * self.unit

    @property
    def pooled_bytes(self) -> int:
        return len(self._pool) * self.unit

    @property
    def mapped_bytes(self) -> int:
        """Physical device memory the buffer holds now."""
        held = sum(h is not None for h in self._handles) + len(self._pool) + (self._spare is not None)
        return held * self.unit

    def _addr(self, u: int) -> int:
        return self._base + u * self.unit

    def release(self, lo: int, hi: int) -> int:
        """The live units wholly inside elements [lo, hi) give their memory back (their handles to the pool while
        it has room, else to the driver) and read the spare unit; returns the bytes given back."""
        if hi <= lo:
            return 0
        inside = self._units_inside(lo, hi)
        with self._lock:
            t0 = time.perf_counter()
            live = inside.start + np.flatnonzero(self._state[inside] == LIVE)
            for first, stop in _runs(live):
                self._drv.unmap(self._addr(first), (stop - first) * self.unit)
                for u in range(first, stop):
                    handle, self._handles[u] = self._handles[u], None
                    self._drv.map(self._addr(u), self._spare)
                    self._go_empty(u)
                    if len(self._pool) + 1 + self._live <= min(self._slots, self._peak):
                        self._pool.append(handle)
                    else:
                        self._drv.release(handle)
                self._drv.access(self._addr(first), (stop - first) * self.unit)
            self.driver_seconds += time.perf_counter() - t0
        return len(live) * self.unit

    def fill(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) are about to be written: their empty units get a handle of their own (a pooled one
        while there are some). Whatever a pooled handle held is overwritten before anything reads it (every
        writer calls this first, and a step's first backward overwrites every gradient)."""
        if not self.needs(lo, hi):
            return
        with self._lock:
            t0 = time.perf_counter()
            for a, b in _runs(self._empty_touched(lo, hi)):
                self._drv.unmap(self._addr(a), (b - a) * self.unit)
                for u in range(a, b):
                    pooled = bool(self._pool)
                    handle = self._pool.pop() if pooled else self._drv.create()
                    self.moved_in += pooled
                    self._drv.map(self._addr(u), handle)
                    self._handles[u] = handle
                    self._go_live(u)
                self._drv.access(self._addr(a), (b - a) * self.unit)
            self.driver_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Unmap and release everything, and free the addresses (the array must not be used after); a second call
        does nothing."""
        drv = self._drv
        if self._base is None:
            return
        for first, stop in _runs(np.flatnonzero(self._mapped)):
            drv.unmap(self._addr(first), (stop - first) * self.unit)
        self._mapped[:] = False
        for u, handle in enumerate(self._handles):
            if handle is not None:
                drv.release(handle)
                self._handles[u] = None
        for handle in self._pool + ([self._spare] if self._spare is not None else []):
            drv.release(handle)
        self._pool, self._spare = [], None
        base, self._base = self._base, None
        drv.free(base, len(self._state) * self.unit)


def _runs(units):
    """Sorted unit numbers as [first, stop) runs of consecutive ones."""
    out = []
    for u in (int(u) for u in units):
        if out and out[-1][1] == u:
            out[-1][1] = u + 1
        else:
            out.append([u, u + 1])
    return [tuple(r) for r in out]
