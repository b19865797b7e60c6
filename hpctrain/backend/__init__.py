"""Backends: where arrays live and kernels run. ``get_backend("auto" | "cpu" | "cuda")``."""

from __future__ import annotations

from ..errors import BackendError
from .base import Backend, check_array

__all__ = ["Backend", "check_array", "get_backend", "cuda_available", "picks_device"]


def cuda_available() -> bool:
    """True when numba-cuda is installed and sees a GPU (or runs the simulator)."""
    if not (_simulator() or _driver_loads()):
        return False  # no driver: numba.cuda would say so after a 0.4 s import (a CPU rank's start-up, ``auto``)
    try:
        from numba import cuda
    except ImportError:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:
        return False


def _driver_loads() -> bool:
    """Whether the CUDA driver library loads, tried where numba-cuda looks for it on Linux (a dlopen, about a
    millisecond); elsewhere, or when ``NUMBA_CUDA_DRIVER`` names it, numba-cuda is asked."""
    import ctypes
    import os
    import sys

    if not sys.platform.startswith("linux") or os.environ.get("NUMBA_CUDA_DRIVER"):
        return True
    names = ["libcuda.so", "libcuda.so.1"]
    for path in names + [os.path.join(d, n) for d in ("/usr/lib", "/usr/lib64") for n in names]:
        try:
            ctypes.CDLL(path)
            return True
        except OSError:
            continue
    return False


def _simulator() -> bool:
    import os

    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def picks_device(name: str) -> bool:
    """Whether ``get_backend(name)`` gives the CUDA backend here (what ``hpctrain plan`` plans for)."""
    return name == "cuda" or (name == "auto" and not _simulator() and cuda_available())


def get_backend(name: str, *, log=None, device_id: int = 0, precision: str = "fp32", arena: bool = True,
                graphs: bool | str = "auto", gemm: str = "auto") -> Backend:
    """Return the backend for ``[train] backend``; ``auto`` prefers a real GPU and logs its choice.

    ``arena`` (``cuda.arena``): the CUDA backend's step arena (backend/arena.py); ``graphs`` (``cuda.graphs``):
    its steps replayed as CUDA graphs (backend/cuda/graphs.py). ``precision`` (``train.precision``): on the CPU "bf16" is cpu/precision.py's reference and "tf32" computes
    in float32 (the CPU has no TF32; logged once); on the CUDA backend "bf16" is cuda/precision.py's rounding at
    the reference's points, and "tf32" the cuBLASLt products in TF32 (float32 in the numba kernels; logged).

    Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) ``auto`` takes the CPU: the simulator is for
    testing kernels, far too slow to train on; ``backend = "cuda"`` still uses it.

    ``gemm`` (``cuda.gemm``): the CUDA backend's GEMM provider, cuBLASLt or the numba kernels
    (backend/cuda/gemm/); "auto" logs why it took the numba ones, "cublaslt" where it cannot be is refused.
    """
    if name == "cpu" or (name == "auto" and (_simulator() or not cuda_available())):
        from .cpu import CpuBackend

        if name == "auto" and log is not None:
            why = "the CUDA simulator is on" if _simulator() else "no GPU found"
            log(f"backend auto: {why}, using the CPU backend")
        if precision == "bf16":
            from .cpu.precision import Bf16CpuBackend

            if log is not None:
                log('train.precision = "bf16": the CPU reference, every product rounded to bfloat16 with float32 '
                    "accumulation, the rest and the master weights float32")
            return Bf16CpuBackend()
        if precision == "tf32" and log is not None:
            log('train.precision = "tf32": the CPU has no TF32, its products compute in float32')
        return CpuBackend()
    if name in ("cuda", "auto"):
        if not cuda_available():
            raise BackendError('backend = "cuda" but no CUDA GPU is available (install hpctrain[cuda] and check nvidia-smi)')
        try:
            from .cuda import CudaBackend
            from .cuda.precision import Bf16CudaBackend
        except ImportError as e:
            raise BackendError(f"the CUDA backend is not available: {e}") from None
        make = Bf16CudaBackend if precision == "bf16" else CudaBackend
        backend = make(device_id=device_id, arena=arena, graphs=graphs, gemm=gemm, tf32=precision == "tf32")
        if backend.gemm_why and log is not None:
            log(f'cuda.gemm = "auto": the numba GEMM kernels, since {backend.gemm_why}')
        if precision == "tf32" and log is not None:
            log('train.precision = "tf32": the Linear products in TF32 through cuBLASLt, attention\'s in float32'
                if backend.gemm_provider == "cublaslt" else
                'train.precision = "tf32": the numba GEMM kernels have no TF32, the products compute in float32')
        if precision == "bf16" and log is not None:
            log('train.precision = "bf16": every product rounded to bfloat16 as the CPU reference rounds it, with '
                "float32 accumulation; values held in float32 (no memory or tensor-core gain yet: docs/gpu.md)")
        if name == "auto" and log is not None:
            log(f"backend auto: using the CUDA backend on {backend.device_name}")
        return backend
    raise BackendError(f"unknown backend {name!r} (expected auto, cpu or cuda)")
