"""Fixtures for tests run under mpiexec (HPCTRAIN_SUBSUITE=mpi mpiexec -n N python -m pytest tests/mpi)."""

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ for helpers, reference


# A test that fails on one rank alone leaves the others waiting in its collectives, and the sub-suite would sit
# until tests/test_suites.py's timeout (15 minutes a run). So a failure is printed at once, naming the rank; a rank
# that failed ends the world FAILURE_GRACE_S later if it is still running; and at the end every rank waits at most
# FAILURE_GRACE_S for the others (a barrier of its own) before ending the world instead of hanging in MPI_Finalize.
FAILURE_GRACE_S = float(os.environ.get("HPCTRAIN_TEST_FAILURE_GRACE", "120"))
_failed = []


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


_finish_comm = _world().Dup()  # collective: every rank imports this conftest while collecting


def pytest_runtest_logreport(report):
    if not report.failed:
        return
    rank = _world().Get_rank()
    sys.__stderr__.write(f"\n[rank {rank}] {report.nodeid} failed ({report.when}):\n{report.longreprtext[-4000:]}\n")
    sys.__stderr__.flush()
    if not _failed:
        import threading

        timer = threading.Timer(FAILURE_GRACE_S, _end_the_world,
                                args=(f"{report.nodeid} failed {FAILURE_GRACE_S:.0f} s ago and this rank still runs",))
        timer.daemon = True
        timer.start()
    _failed.append(report.nodeid)


def _end_the_world(why: str) -> None:
    sys.__stderr__.write(f"[rank {_world().Get_rank()}] {why}: the other ranks may be waiting for this one in a "
                         "collective; ending the world\n")
    sys.__stderr__.flush()
    _world().Abort(1)


def pytest_sessionfinish(session, exitstatus):
    import time

    request = _finish_comm.Ibarrier()
    deadline = time.monotonic() + FAILURE_GRACE_S
    while not request.Test():
        if time.monotonic() > deadline:
            _end_the_world(f"this rank's tests ended and another rank's had not {FAILURE_GRACE_S:.0f} s later")
        time.sleep(0.05)
    _finish_comm.Free()


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
