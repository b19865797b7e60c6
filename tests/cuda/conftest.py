"""The CUDA sub-suite: every CUDA kernel against the numpy references and the CPU backend.

    HPCTRAIN_SUBSUITE=cuda NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda   # no GPU: the simulator
    HPCTRAIN_SUBSUITE=cuda python -m pytest tests/cuda                          # on a GPU

Under the simulator every GPU thread is a Python thread, so shapes are tiny and the
backend's launch shapes are the simulator defaults (16 threads per block, 8×8 GEMM
tiles). Tests that need a real device carry ``cudatest.needs_gpu(reason)``.
"""

import sys

import numpy as np
import pytest
from numba import cuda

from cudatest import SIM
from hpctrain.backend.cpu import CpuBackend
from hpctrain.backend.cuda import CudaBackend

if SIM:
    # The simulator's block manager polls its threads at every syncthreads(); with Python's default
    # 5 ms thread switch interval each barrier costs several switch intervals. 50 µs makes the
    # barrier-heavy kernels (GEMM tiles, block reductions) about 10x faster.
    sys.setswitchinterval(5e-5)


def pytest_collection_modifyitems(config, items):
    if not cuda.is_available():
        skip = pytest.mark.skip(reason="numba.cuda sees no GPU; run with NUMBA_ENABLE_CUDASIM=1 for the simulator")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def be():
    return CudaBackend()


@pytest.fixture(scope="session")
def cpu():
    return CpuBackend()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(autouse=True)
def poison_uninitialised_memory(monkeypatch):
    """Under the simulator, ``empty`` hands out NaN-filled arrays, so a kernel that reads memory it
    never wrote fails every time instead of now and then (numpy's empty memory is often zeros). The copy is a
    host action like the backend's own (``_host_acts``): the kernels a replayed segment still holds run first
    (backend/cuda/graphs.py), since the slab memory it fills may be what they read. Each one ends a segment, so
    the tests' steps have more segments than a real one."""
    if not SIM:
        return
    original = CudaBackend.empty

    def poisoned(self, shape, dtype=np.float32):
        out = original(self, shape, dtype)
        if np.dtype(dtype).kind == "f":  # a host copy: what the replayed segments hold is queued first
            self._host_acts()
            out.copy_to_device(np.full(out.shape, np.nan, dtype=out.dtype))
        return out

    monkeypatch.setattr(CudaBackend, "empty", poisoned)
