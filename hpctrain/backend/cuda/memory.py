"""Device memory for the CUDA backend: a caching pool, and out-of-memory errors that say what failed.

Why a pool: layers ask for a fresh activation or gradient array (``backend.empty``)
for every layer of every step. ``cudaMalloc``/``cudaFree`` are slow and synchronise
the device, and numba's default allocator calls them for each array. The pool
keeps every block it ever allocated: when the last array (or view: slice,
reshape) over a block is garbage-collected, the block goes back on a free list
keyed by its rounded byte size, and the next request of that size reuses it
without touching the driver. Training repeats the same shapes every step, so
after the first step no allocation reaches the driver.

Why this is safe: the backend issues every kernel and copy on one stream, so
work queued on a block by its previous owner finishes before anything the next
owner queues on it. Code that hands a pool array to another stream or to MPI keeps a
reference to it until that use is over on the host: the pipeline's sender thread
holds an array until its copy out has finished (or, handed to a CUDA-aware MPI, until
its Isend completes), so the block cannot be reused before. The last reference may
then go on that thread, so the free lists are guarded by a lock.

How an array keeps its block: the array is built with
``cuda.from_cuda_array_interface(..., owner=lease)``; numba's device-array views
hold a reference to that owner, so the ``_Lease`` lives exactly as long as any
array or view over the block, and its ``__del__`` hands the block back.

The pool itself holds every block it owns (``_owned``), leased or cached, and each
lease holds the pool. Without that, an array that ends in a reference cycle loses
its block: CPython's cycle collector runs weak-reference callbacks (numba frees the
device memory in one) and clears weak references inside the garbage before it
calls ``__del__`` (seen on an H200 as "weakly-referenced object no longer exists"
at a later allocation).

When the device is full, the pool first releases every cached block to the
driver and retries once; if that fails too the caller gets a ``BackendError``
naming the operation, the shape and the bytes requested.

Under the CUDA simulator there are no device pointers: arrays are plain
``cuda.device_array`` (numpy underneath) and the pool is not used.
"""

from __future__ import annotations

import math
import threading

import numpy as np
from numba import cuda

from ...errors import BackendError

__all__ = ["DevicePool", "is_out_of_memory", "out_of_memory_error", "is_device_array", "flat", "raw_alloc", "wrap",
           "wrap_address", "slab_array", "arena_refs", "memory_root"]

_GRANULE = 512  # bytes; cudaMalloc aligns to at least this anyway
_CUDA_ERROR_OUT_OF_MEMORY = 2


def is_out_of_memory(error: BaseException) -> bool:
    """True for numba's CudaAPIError(CUDA_ERROR_OUT_OF_MEMORY) and for a host MemoryError."""
    if isinstance(error, MemoryError):
        return True
    code = getattr(error, "code", None)
    try:
        if code is not None and int(code) == _CUDA_ERROR_OUT_OF_MEMORY:
            return True
    except (TypeError, ValueError):
        pass
    text = str(error).upper().replace(" ", "_")
    return "OUT_OF_MEMORY" in text


def out_of_memory_error(op: str, shape, dtype, where: str, error: BaseException) -> BackendError:
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    return BackendError(f"{op}: out of {where} memory allocating shape {tuple(shape)} {np.dtype(dtype).name} "
                        f"({nbytes / 2**20:.1f} MiB): {error}. Lower train.batch_size or the model width, "
                        "or use more ranks")


def rounded_bytes(nbytes: int) -> int:
    """The size class of a request: the byte count rounded up to the allocation granule."""
    return max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)


class _Lease:
    """Held (through numba's view references) by every array over one block; returns the block when freed.

    It holds the pool strongly: a weak reference that is itself part of a garbage cycle is cleared by the
    cycle collector before ``__del__`` runs, and the block would then be lost to the pool."""

    __slots__ = ("pool", "size", "block")

    def __init__(self, pool, size, block):
        self.pool, self.size, self.block = pool, size, block

    def __del__(self):
        self.pool._give_back(self.size, self.block)


class DevicePool:
    """Caching allocator over ``raw_alloc(nbytes) -> block``; ``wrap(block, shape, dtype, owner) -> array``.

    ``alloc`` raises whatever ``raw_alloc`` raises after one retry with the cache emptied;
    the backend turns an out-of-memory error into a ``BackendError``.
    """

    def __init__(self, raw_alloc, wrap):
        self._raw_alloc, self._wrap = raw_alloc, wrap
        self._free: dict[int, list] = {}
        self._owned: dict[int, object] = {}  # id -> block: every block the pool has not released
        self.hits = self.misses = 0
        self.cached_bytes = 0  # bytes on the free lists
        self.leased_bytes = 0  # bytes in arrays that are alive
        # a communication thread may drop the last reference to a sent array (its lease gives the block back
        # there) while the training thread allocates; reentrant: a collection inside ``alloc`` may free a lease
        self._lock = threading.RLock()

    def alloc(self, shape, dtype):
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        size = rounded_bytes(math.prod(shape) * dtype.itemsize)
        with self._lock:
            blocks = self._free.get(size)
            block = blocks.pop() if blocks else None
            if block is not None:
                self.cached_bytes -= size
                self.hits += 1
            else:
                block = self._new_block(size)
            self.leased_bytes += size
        return self._wrap(block, shape, dtype, _Lease(self, size, block))

    def _new_block(self, size):
        try:
            block = self._raw_alloc(size)
        except Exception as e:
            if not is_out_of_memory(e) or not self.cached_bytes:
                raise
            self.release_cached()  # other sizes may be sitting idle: give them back and retry once
            block = self._raw_alloc(size)
        self._owned[id(block)] = block
        self.misses += 1
        return block

    def _give_back(self, size, block):
        with self._lock:
            self.leased_bytes -= size
            self.cached_bytes += size
            self._free.setdefault(size, []).append(block)

    def release_cached(self) -> None:
        """Drop every idle block (numba frees them); arrays in use are not affected."""
        with self._lock:
            for blocks in self._free.values():
                for block in blocks:
                    self._owned.pop(id(block), None)
            self._free.clear()
            self.cached_bytes = 0


def is_device_array(arr) -> bool:
    return bool(getattr(arr, "__cuda_ndarray__", False) or hasattr(arr, "__cuda_array_interface__"))


def flat(arr):
    """A 1-D view of a C-contiguous device array (the element-wise kernels index flat)."""
    return arr if arr.ndim == 1 else arr.reshape(arr.size)


def raw_alloc(nbytes):
    """``nbytes`` of device memory from the driver (the pool's source)."""
    return cuda.current_context().memalloc(nbytes)


def wrap(block, shape, dtype, owner):
    """A device array over a pool block that ``owner`` (its lease) keeps alive."""
    desc = {"shape": shape, "strides": None, "typestr": dtype.str, "data": (block.device_pointer_value, False),
            "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)


def wrap_address(address, n, owner):
    """``n`` float32 at a device address that ``owner`` holds (a ReleasableDevice's reserved range)."""
    desc = {"shape": (n,), "strides": None, "typestr": "<f4", "data": (address, False), "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)


class _SlabPiece:
    """The owner of one array over the step arena's slab: every view of the array holds it, and it holds the slab
    (so a slab the arena let go lives while any array over it does)."""

    __slots__ = ("slab",)

    def __init__(self, slab):
        self.slab = slab


def slab_array(slab, offset, shape, dtype):
    """An array of ``shape`` and ``dtype`` at ``offset`` bytes into ``slab`` (a pool array), with its own owner."""
    desc = {"shape": tuple(shape), "strides": None, "typestr": np.dtype(dtype).str,
            "data": (slab.device_ctypes_pointer.value + offset, False), "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=_SlabPiece(slab), sync=False)


def arena_refs(arr) -> tuple:
    """What every view of ``arr`` references (backend/arena.py counts them): the array itself; on a GPU its
    memory pointer (shared by reshapes) and that pointer's owner (held by slices); under the simulator the numpy
    array underneath (the base of every view)."""
    data = getattr(arr, "gpu_data", None)
    if data is None:  # the simulator's FakeCUDAArray
        return arr, arr._ary
    return arr, data, data.owner


def memory_root(arr):
    """The object that every view of ``arr``'s memory shares: on a GPU its pointer's owner (the pool's lease, the
    arena's piece), under the simulator the numpy array that is the base of every view."""
    data = getattr(arr, "gpu_data", None)
    if data is None:
        ary = arr._ary
        return ary.base if isinstance(ary.base, np.ndarray) else ary
    return data.owner
