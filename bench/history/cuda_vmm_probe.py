"""What CUDA's virtual memory management (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemUnmap) costs and does on
this GPU: the ground for zero = 2 on a device, whose gradient buffer would give back the physical memory outside the
rank's chunks once a bucket is reduced, as ReleasableHost does on the host (parallel/grad_pages.py).

    python bench/history/cuda_vmm_probe.py [--units 64]

Prints: the allocation granularity; that a numba kernel writes and reads a buffer mapped unit by unit; the device's
free memory before and after unmapping half the units (released handles); the host time of one unit's unmap and of
one map + access grant; whether an unmap waits for a kernel still running on the device (a long kernel on another
part of the buffer); and whether a handle unmapped and mapped again at another address keeps its bytes (a pool of
handles, like ReleasableHost's page pool). Needs a GPU, numba-cuda and cuda-python's driver bindings.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _ok(result):
    """cuda.bindings' (err, value...) tuple: the value(s), or RuntimeError naming the error."""
    from cuda.bindings import driver as d

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver: {err}")
    return rest[0] if len(rest) == 1 else (rest or None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--units", type=int, default=64)
    args = p.parse_args(argv)
    from cuda.bindings import driver as d
    from numba import cuda

    ctx = cuda.current_context()  # numba's primary context, current on this thread for the driver calls below
    dev = ctx.device.id
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dev
    access = d.CUmemAccessDesc()
    access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = dev
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    gran = int(_ok(d.cuMemGetAllocationGranularity(prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
    rec = int(_ok(d.cuMemGetAllocationGranularity(prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
    print(f"granularity: minimum {gran} B, recommended {rec} B")
    unit, n_units = gran, args.units
    size = unit * n_units
    va = int(_ok(d.cuMemAddressReserve(size, 0, 0, 0)))
    handles = [None] * n_units

    def map_unit(u, h=None):
        h = h if h is not None else _ok(d.cuMemCreate(unit, prop, 0))
        _ok(d.cuMemMap(va + u * unit, unit, 0, h, 0))
        _ok(d.cuMemSetAccess(va + u * unit, unit, [access], 1))
        handles[u] = h

    def unmap_unit(u, keep=False):
        _ok(d.cuMemUnmap(va + u * unit, unit))
        h, handles[u] = handles[u], None
        if not keep:
            _ok(d.cuMemRelease(h))
        return h

    t = time.perf_counter()
    for u in range(n_units):
        map_unit(u)
    print(f"map {n_units} units: {(time.perf_counter() - t) / n_units * 1e6:.1f} us a unit (create + map + access)")
    n = size // 4
    arr = cuda.from_cuda_array_interface({"shape": (n,), "typestr": "<f4", "data": (va, False), "version": 3},
                                         owner=None, sync=False)

    @cuda.jit
    def fill(a, base):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = base + i

    @cuda.jit
    def spin(a, rounds):  # one thread keeps the device busy, writing its element again and again
        if cuda.grid(1) == 0:
            x = a[0]
            for r in range(rounds):
                x = x * 0.999999 + 1.0
            a[0] = x

    fill[(n + 255) // 256, 256](arr, np.float32(0))
    cuda.synchronize()
    host = arr.copy_to_host()
    print("kernel over the mapped units:", "values right" if np.array_equal(host, np.arange(n, dtype=np.float32))
          else "VALUES WRONG")

    free0, _total = _ok(d.cuMemGetInfo())
    t = time.perf_counter()
    for u in range(n_units // 2, n_units):
        unmap_unit(u)
    per_unmap = (time.perf_counter() - t) / (n_units - n_units // 2)
    free1, _ = _ok(d.cuMemGetInfo())
    print(f"unmap + release {n_units - n_units // 2} units: {per_unmap * 1e6:.1f} us a unit; device free memory "
          f"{(free1 - free0) / 2**20:+.1f} MiB (released {(n_units - n_units // 2) * unit / 2**20:.1f} MiB)")
    t = time.perf_counter()
    for u in range(n_units // 2, n_units):
        map_unit(u)
    print(f"map again: {(time.perf_counter() - t) / (n_units - n_units // 2) * 1e6:.1f} us a unit")

    # does an unmap wait for a kernel still running (on unit 0) elsewhere in the buffer?
    head = arr[: unit // 4]
    spin[1, 1](head, 50_000_000)
    cuda.synchronize()
    t = time.perf_counter()
    spin[1, 1](head, 50_000_000)
    cuda.synchronize()
    kernel_s = time.perf_counter() - t
    spin[1, 1](head, 50_000_000)
    t = time.perf_counter()
    unmap_unit(n_units - 1)
    unmap_s = time.perf_counter() - t
    t = time.perf_counter()
    map_unit(n_units - 1)
    map_s = time.perf_counter() - t
    cuda.synchronize()
    print(f"with a {kernel_s * 1e3:.0f} ms kernel running: unmap took {unmap_s * 1e3:.2f} ms, map {map_s * 1e3:.2f} ms "
          f"({'the unmap WAITS for the device' if unmap_s > kernel_s / 2 else 'neither waits for the device'})")

    # a pooled handle: unmapped, kept, mapped at another unit's address; are its bytes still there?
    fill[(n + 255) // 256, 256](arr, np.float32(0))
    cuda.synchronize()
    a, b = 1, n_units - 2
    h = unmap_unit(b, keep=True)
    unmap_unit(a)
    map_unit(a, h)
    cuda.synchronize()
    per = unit // 4
    got = arr[a * per:(a + 1) * per].copy_to_host()
    moved = np.array_equal(got, np.arange(b * per, (b + 1) * per, dtype=np.float32))
    print("a handle mapped at another address:", "keeps its bytes" if moved else "does not keep its bytes")
    map_unit(b)

    # each call on its own (host µs a unit, the mean over the units of the buffer's second half)
    half = range(n_units // 2, n_units)
    cost = {}

    def timed(name, fn):
        t = time.perf_counter()
        out = [fn(u) for u in half]
        cost[name] = (time.perf_counter() - t) / len(half) * 1e6
        return out

    timed("cuMemUnmap", lambda u: _ok(d.cuMemUnmap(va + u * unit, unit)))
    old = [handles[u] for u in half]
    timed("cuMemRelease", lambda u: _ok(d.cuMemRelease(old[u - half.start])))
    new = timed("cuMemCreate", lambda u: _ok(d.cuMemCreate(unit, prop, 0)))
    timed("cuMemMap", lambda u: _ok(d.cuMemMap(va + u * unit, unit, 0, new[u - half.start], 0)))
    timed("cuMemSetAccess", lambda u: _ok(d.cuMemSetAccess(va + u * unit, unit, [access], 1)))
    for u in half:
        handles[u] = new[u - half.start]
    print("one call a unit: " + ", ".join(f"{k} {v:.1f} us" for k, v in cost.items()))
    # one call over a run of units mapped one by one: does the driver take it?
    run = n_units // 2
    for name, call in (("cuMemSetAccess", lambda: d.cuMemSetAccess(va + run * unit, 4 * unit, [access], 1)),
                       ("cuMemUnmap", lambda: d.cuMemUnmap(va + run * unit, 4 * unit))):
        t = time.perf_counter()
        err = call()[0]
        print(f"{name} over 4 units mapped one by one: {err} ({(time.perf_counter() - t) * 1e6:.1f} us)")
    if err == d.CUresult.CUDA_SUCCESS:
        for u in range(run, run + 4):
            _ok(d.cuMemRelease(handles[u]))
            handles[u] = None
            map_unit(u)
    for u in range(n_units):
        unmap_unit(u)
    _ok(d.cuMemAddressFree(va, size))
    print("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
