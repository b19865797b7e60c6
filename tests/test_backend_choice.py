"""``train.backend = "auto"``: how a rank decides whether there is a GPU, and what that costs a CPU rank."""

import subprocess
import sys

import pytest

import hpctrain.backend as backend

NO_DRIVER = """
import ctypes, sys
real = ctypes.CDLL
def refuse(name, *a, **k):  # a machine without the driver, here and on a GPU machine alike
    if "libcuda" in str(name):
        raise OSError(name + ": cannot open shared object file")
    return real(name, *a, **k)
ctypes.CDLL = refuse
from hpctrain.backend import cuda_available, get_backend
assert cuda_available() is False
lines = []
be = get_backend("auto", log=lines.append)
assert lines == ["backend auto: no GPU found, using the CPU backend"], lines
assert "numba.cuda" not in sys.modules, "asked numba.cuda (a 0.4 s import) with no driver to find"
print(type(be).__name__)
"""


def test_with_no_cuda_driver_auto_takes_the_cpu_without_importing_numba_cuda(monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    monkeypatch.delenv("NUMBA_CUDA_DRIVER", raising=False)
    out = subprocess.run([sys.executable, "-c", NO_DRIVER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "CpuBackend"


def test_the_driver_check_tries_numba_cudas_names_and_defers_to_numba_where_told(monkeypatch):
    tried = []

    def refuse(path, *a, **k):
        tried.append(path)
        raise OSError(path)

    monkeypatch.setattr("ctypes.CDLL", refuse)
    monkeypatch.delenv("NUMBA_CUDA_DRIVER", raising=False)
    assert backend._driver_loads() is False
    assert tried[:2] == ["libcuda.so", "libcuda.so.1"] and "/usr/lib64/libcuda.so.1" in tried
    monkeypatch.setenv("NUMBA_CUDA_DRIVER", "/opt/driver/libcuda.so")  # numba-cuda loads that one: ask it
    assert backend._driver_loads() is True
    monkeypatch.delenv("NUMBA_CUDA_DRIVER")
    monkeypatch.setattr("ctypes.CDLL", lambda path, *a, **k: object())
    assert backend._driver_loads() is True


class _Ranks:
    """A world of ranks whose GEMM providers are ``others`` (besides this one): Allreduce(MIN) over them."""

    def __init__(self, *others):
        self.others = others

    def Allreduce(self, _in_place, buf, op):
        buf[0] = min([int(buf[0]), *(1 if p == "cublaslt" else 0 for p in self.others)])


class _DeviceBackend:
    is_device = True

    def __init__(self, provider):
        self.gemm_provider, self.gemm_why = provider, ""

    def use_numba(self, why):
        self.gemm_provider, self.gemm_why = "numba", why


@pytest.mark.parametrize("mine, others, want, said", [
    ("cublaslt", ("cublaslt", "cublaslt"), "cublaslt", []),
    ("cublaslt", ("cublaslt", "numba"), "numba",
     ['cuda.gemm = "auto": the numba GEMM kernels on every rank, since another rank has no cuBLASLt']),
    ("numba", ("cublaslt",), "numba", []),  # this rank said why when it chose (get_backend)
])
def test_every_rank_runs_the_same_gemm_provider(mine, others, want, said):
    """cuda.gemm = "auto" on a node without cuBLASLt: every rank takes the numba kernels (train/startup.py's
    agree_gemm, collective at start-up), so a product's bits do not depend on the rank that runs it."""
    from hpctrain.train.startup import agree_gemm

    be, lines = _DeviceBackend(mine), []
    agree_gemm(be, _Ranks(*others), lines.append)
    assert be.gemm_provider == want and lines == said
    assert (be.gemm_why == "another rank has no cuBLASLt") == bool(said)
