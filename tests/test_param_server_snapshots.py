"""The parameter server's answers share one copy of its range per version and hold at most staleness + 2
(hpctrain/parallel/param_server.py ``_Snapshots``), so its memory does not grow with the number of workers."""

import numpy as np
from mpi4py import MPI

from hpctrain.parallel.param_server import _Snapshots


def test_pulls_of_one_version_share_one_copy():
    snaps = _Snapshots(limit=2)
    params = np.arange(4, dtype=np.float32)
    a = snaps.get(0, params)
    snaps.sent(0, MPI.REQUEST_NULL)
    b = snaps.get(0, params)  # another worker, same version
    assert a is b and len(snaps) == 1
    params += 1  # the next update: the copy sent at version 0 keeps its values
    c = snaps.get(1, params)
    assert c is not a and a.tolist() == [0, 1, 2, 3] and c.tolist() == [1, 2, 3, 4]


def test_at_most_limit_copies_and_completed_ones_are_dropped_oldest_first():
    comm = MPI.COMM_SELF
    snaps = _Snapshots(limit=3)
    params = np.zeros(8, dtype=np.float32)
    inbox = [np.empty(8, dtype=np.float32) for _ in range(3)]
    snaps.get(0, params)
    pending = comm.Irecv(inbox[0], source=0, tag=7)  # a send of version 0 still in flight: its receive unmatched
    snaps.sent(0, pending)
    for v in (1, 2):
        snaps.get(v, params)
        snaps.sent(v, MPI.REQUEST_NULL)  # complete
    snaps.reap()
    assert len(snaps) == 3  # version 0 has not completed: nothing behind it is dropped either (O(1) per call)
    comm.Send(np.ones(8, dtype=np.float32), dest=0, tag=7)  # version 0's transfer completes
    snaps.reap()
    assert len(snaps) == 0 and snaps.peak == 3
    for v in range(3, 10):  # never more than the limit, whatever the versions
        snaps.get(v, params)
        snaps.sent(v, MPI.REQUEST_NULL)
        assert len(snaps) <= 3
    snaps.wait_all()
    assert len(snaps) == 0 and snaps.peak == 3
