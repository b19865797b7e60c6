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


@pytest.fixture
def data(shared_dir, comm):
    """A 128-row classification file (tests/helpers.py) in the shared folder, written by rank 0."""
    from helpers import make_classification

    path = f"{shared_dir}/d.h5"
    if comm.rank == 0:
        make_classification(path, n=128)
    comm.Barrier()
    return path


@pytest.fixture
def tokens(shared_dir, comm):
    """A small character token file (tests/helpers.py make_tokens) in the shared folder, written by rank 0."""
    from helpers import make_tokens

    path = f"{shared_dir}/t.h5"
    if comm.rank == 0:
        make_tokens(path)
    comm.Barrier()
    return path
