"""Fixtures for tests run under mpiexec (HPCTRAIN_SUBSUITE=mpi mpiexec -n N python -m pytest tests/mpi)."""

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ for helpers, reference


@pytest.fixture(scope="session")
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture
def shared_dir(comm):
    """One temporary folder every rank sees (all ranks run on this node in the test suite)."""
    name = np.zeros(256, dtype=np.uint8)
    if comm.rank == 0:
        path = tempfile.mkdtemp(prefix="hpctrain-mpi-").encode()
        name[: len(path)] = np.frombuffer(path, dtype=np.uint8)
    comm.Bcast(name, root=0)
    path = name.tobytes().rstrip(b"\0").decode()
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
