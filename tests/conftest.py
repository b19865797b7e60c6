"""Test harness.

``pytest`` from the repository root runs everything:

* the single-process tests in tests/*.py;
* tests/mpi/ under ``mpiexec -n 1`` and ``mpiexec -n 2`` (tests/test_suites.py
  launches them; expectations are computed from the world size);
* tests/cuda/ under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) in a
  subprocess, so the rest of the suite keeps the real CPU backend.

The sub-suites are collected only when ``HPCTRAIN_SUBSUITE`` names them, so
they can be run by hand too:

    HPCTRAIN_SUBSUITE=mpi mpiexec -n 2 python -m pytest tests/mpi
    HPCTRAIN_SUBSUITE=cuda NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda   # no GPU
    HPCTRAIN_SUBSUITE=cuda python -m pytest tests/cuda                          # on a GPU
"""

import os

import pytest

import hpctrain  # noqa: F401  before numpy: shares the cores between the ranks' BLAS threads (hpctrain/_threads.py)

# the start-up scan's records (hpctrain/scan_cache.py) stay off: a test that writes a bad file must see the scan,
# and nothing here writes under ~/.cache; tests/test_scan_cache.py turns them on in a folder of its own
os.environ.setdefault("HPCTRAIN_CACHE_DIR", "off")

_subsuite = os.environ.get("HPCTRAIN_SUBSUITE", "")
collect_ignore = [name for name in ("mpi", "cuda") if name != _subsuite]


def pytest_report_header(config):
    lines = []
    try:
        from mpi4py import MPI

        lines.append(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}, world size {MPI.COMM_WORLD.Get_size()}")
    except Exception as e:  # report, do not hide
        lines.append(f"MPI: unavailable ({e})")
    if _subsuite:
        lines.append(f"hpctrain sub-suite: {_subsuite}, CUDA simulator: {os.environ.get('NUMBA_ENABLE_CUDASIM', '0')}")
    return lines


@pytest.fixture(scope="module")
def mesh():
    """A one-process Mesh over COMM_WORLD for a test module's Trainers (freed after the module)."""
    from hpctrain.parallel.mesh import Mesh

    m = Mesh()
    yield m
    m.free()
