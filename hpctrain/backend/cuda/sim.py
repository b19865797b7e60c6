"""A fix for numba-cuda's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``): thread-safe shared arrays.

The simulator runs every GPU thread of a block as a Python thread and gives
``cuda.shared.array(shape, dtype)`` block-wide identity by the calling source
line: the first thread to reach the line creates the array and stores it in a
per-launch dict, the others look it up. numba-cuda (0.30.x) does that
check-then-store without a lock::

    res = self._allocations.get(caller)        # thread A: None ... GIL switch
    if res is None:                            # thread B: None, creates and stores its own
        res = np.empty(shape, dtype)           # thread A: creates another one
        self._allocations[caller] = res        # and overwrites B's

so when the interpreter switches threads inside that window, threads of the
block's first launch end up with *different* "shared" arrays: a block reduction
or a GEMM tile then reads another thread's never-written ``np.empty`` memory
(garbage, sometimes NaN) and the kernel silently returns wrong values. It is
rare (about 1 launch in 500 with the test suite's 50 µs switch interval and a
pytest-deep stack, under load), which made whole training runs fail now and then
with "the gradients contain NaN or Inf". See tests/cuda/test_cuda_simulator.py.

``install()`` replaces ``FakeCUDAShared.array`` with the same lookup, keyed by
the same (file, line) of the caller, done under a lock. It is called by the
kernel factories (blocks.kernel_decorator, gemm/tiled.py's, flash.py's) and does
nothing on a real GPU. Shared arrays still alias by source line, as before: one
``cuda.shared.array(...)`` per line (docs: DESIGN.md).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["install", "simulator", "kernel_jit", "inlined_device_jit"]

_lock = threading.Lock()
_installed = False


def simulator() -> bool:
    """Whether numba-cuda's simulator is on (kernels then run as Python, and libdevice is absent)."""
    from numba.cuda.core import config

    return bool(config.ENABLE_CUDASIM)


def kernel_jit(threads: int):
    """``cuda.jit`` for a kernel launched with ``threads`` threads per block. Above 256 threads, with launch
    bounds, so that the compiler keeps its registers within what a block of that size may use (without,
    a 1024-thread block of a kernel needing more than 64 registers fails to launch). At 256 or fewer
    the 255-register limit cannot be exceeded, and bounds there made ptxas trade registers for spills
    (tests/test_cuda_compile.py). The simulator has no launch bounds."""
    from numba import cuda

    return cuda.jit if simulator() or threads <= 256 else cuda.jit(launch_bounds=threads)


def inlined_device_jit():
    """``cuda.jit`` for a device function that its kernels inline (the GEMM's operand loads and tile product).

    NVVM inlines it (``forceinline``: an ``alwaysinline`` attribute in the IR) rather than numba's IR-level
    ``inline="always"``, which deep-copies the function's IR into each caller: the GEMM kernels' machine code is
    the same instruction for instruction on sm_80 and sm_90, and they compile in half the time (a GPU job's first
    step, and tests/test_cuda_compile.py). The simulator's ``cuda.jit`` has no such option (nor do numba-cuda
    releases before it); there the function is inlined at the IR level as before."""
    import inspect

    from numba import cuda

    if not simulator() and "forceinline" in inspect.signature(cuda.jit).parameters:
        return cuda.jit(device=True, forceinline=True)
    return cuda.jit(device=True, inline="always")


def install() -> None:
    """Make the simulator's static shared arrays thread-safe (idempotent; a no-op off the simulator)."""
    global _installed
    if _installed or not simulator():
        return
    with _lock:
        if _installed:
            return
        from numba.cuda.simulator import kernelapi

        shared_cls = kernelapi.FakeCUDAShared
        original = shared_cls.array

        def array(self, shape, dtype, alignment=None):
            # Dynamic shared memory (shape 0) and the alignment error take no per-line identity: as before.
            if alignment is not None or (not isinstance(shape, tuple) and shape == 0):
                return original(self, shape, dtype, alignment)
            frame = sys._getframe(1)  # the kernel (or device function) line, as the simulator's stack[-2]
            caller = (frame.f_code.co_filename, frame.f_lineno)
            del frame
            with _lock:  # one kernel runs at a time in the simulator: one lock for every launch is enough
                res = self._allocations.get(caller)
                if res is None:
                    res = self._allocations[caller] = np.empty(shape, _as_dtype(dtype))
            return res

        array.__doc__ = "Thread-safe FakeCUDAShared.array (hpctrain.backend.cuda.sim)."
        array._hpctrain_thread_safe = True
        shared_cls.array = array
        _installed = True


def _as_dtype(dtype):
    from numba.core import types
    from numba.np import numpy_support

    return numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
