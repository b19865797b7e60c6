"""The parameter server's answers share copies of its range and hold at most ``SNAPSHOTS`` (2) of them whatever
the number of workers and the staleness (hpctrain/parallel/param_server.py ``_Snapshots``): a pull that finds
every copy still being sent takes the newest one if it already holds what the bound promises that pull, else it
waits, and the server answers it once a copy's sends have completed.

The sends go to this process over ``COMM_SELF`` in synchronous mode, so each completes only when the test
receives it: a worker that has not yet waited for its parameters."""

import numpy as np
from mpi4py import MPI

from hpctrain.parallel.param_server import SNAPSHOTS, TAGS, Server, _Snapshots


def test_pulls_of_one_version_share_one_copy():
    snaps = _Snapshots(limit=2)
    params = np.arange(4, dtype=np.float32)
    v, a = snaps.answer(0, 0, params, needs=None)
    snaps.sent(0, MPI.REQUEST_NULL)
    _, b = snaps.answer(0, 0, params, needs=None)  # another worker, same version
    assert v == 0 and a is b and len(snaps) == 1
    params += 1  # the next update: the copy sent at version 0 keeps its values
    v, c = snaps.answer(1, 0, params, needs=None)
    assert v == 1 and c is not a and a.tolist() == [0, 1, 2, 3] and c.tolist() == [1, 2, 3, 4]


def test_at_the_limit_a_pull_shares_the_newest_copy_if_it_holds_enough_else_waits():
    comm = MPI.COMM_SELF
    snaps = _Snapshots(limit=2)
    params = np.zeros(8, dtype=np.float32)
    inbox = np.empty(8, dtype=np.float32)
    for version, floor in ((0, 0), (1, 3)):  # two copies, each with a send still in flight
        _, data = snaps.answer(version, floor, params, needs=None)
        snaps.sent(version, comm.Issend(data, dest=0, tag=version))
        params += 1
    assert snaps.answer(2, 5, params, needs=3)[0] == 1  # version 1's copy holds every worker's first 3 gradients
    assert snaps.answer(2, 5, params, needs=4) is None  # it does not hold 4: the pull waits
    assert snaps.answer(2, 5, params, needs=None) is None  # staleness 0: only this version's copy will do
    assert len(snaps) == 2 and not snaps.reap()
    comm.Recv(inbox, source=0, tag=1)  # the newer copy's send completes first: its slot is freed all the same
    assert snaps.reap() and len(snaps) == 1
    version, data = snaps.answer(2, 5, params, needs=4)
    assert version == 2 and data.tolist() == [2.0] * 8 and len(snaps) == 2 and snaps.peak == 2
    snaps.sent(2, MPI.REQUEST_NULL)
    comm.Recv(inbox, source=0, tag=0)
    assert inbox.tolist() == [0.0] * 8  # version 0's copy, sent before the two updates
    snaps.wait_all()
    assert len(snaps) == 0


class _World:
    """The server's world: each send goes to this process (``COMM_SELF``, synchronous mode, tag ``100 * dest +
    tag``), so a send completes only once ``take`` receives it."""

    def __init__(self):
        self.sent = []  # (dest, tag)

    def Isend(self, buf, dest, tag):
        self.sent.append((dest, tag))
        return MPI.COMM_SELF.Issend(buf, dest=0, tag=100 * dest + tag)

    def Get_rank(self):
        return 0

    def Iprobe(self, source, tag, status):
        return False  # no worker writes: the server waits only for a copy to be freed

    def take(self, dest, size):
        """What the worker at world rank ``dest`` receives for one pull: (version, parameters)."""
        version, params = np.empty(1, dtype=np.int64), np.empty(size, dtype=np.float32)
        MPI.COMM_SELF.Recv(version, source=0, tag=100 * dest + TAGS["VERSION"])
        status = MPI.Status()
        MPI.COMM_SELF.Recv(params, source=0, tag=100 * dest + TAGS["PARAMS"], status=status)
        return int(version[0]), params[: status.Get_count(MPI.FLOAT)].tolist()


def _server(workers, staleness, budget=None):
    params = np.zeros(4, dtype=np.float32)

    def optimizer(grad, version, sum_norm):
        params[:] += 1.0  # each update adds one: a copy's values tell its version

    return Server(world=_World(), servers_comm=MPI.COMM_SELF, workers=workers, staleness=staleness, params=params,
                  grads=np.zeros(4, dtype=np.float32), optimizer=optimizer, budget=budget)


def _pull(server, w, clock):
    server._pending.append((w, clock))
    server._answer()


def _push(server, w, version_read):
    server._apply(w, version_read, server.grads, None)
    server._answer()


def test_the_server_never_holds_more_copies_than_the_limit_and_answers_a_waiting_pull_once_one_is_free():
    server = _server(workers=2, staleness=1)
    world = server.world
    _pull(server, 0, 0)
    _pull(server, 1, 0)  # both at version 0: one copy
    _push(server, 0, 0)
    _pull(server, 0, 1)  # version 1: a second copy (its floor: worker 1 has pushed nothing yet)
    _push(server, 1, 0)
    _pull(server, 1, 1)  # version 2, no free slot: version 1's copy holds the 0 = 1 - k gradients it needs
    _push(server, 0, 1)
    assert len(server.snapshots) == SNAPSHOTS == 2 and server.granted == 4
    _pull(server, 0, 2)  # the bound lets it go (the slowest pushed 1 = 2 - k), but no copy holds that gradient
    assert server._deferred and server._pending == [(0, 2)] and server.granted == 4
    assert [world.take(1 + w, 4) for w in (0, 1)] == [(0, [0.0] * 4)] * 2  # the workers wait for step 0's
    assert not server._wait_for_message(MPI.Status())  # version 0's copy is free: no message, a pull to answer
    server._answer()
    assert server._pending == [] and not server._deferred and server.granted == 5 and server.snapshots.peak == 2
    assert world.take(1, 4)[0] == 1 and world.take(2, 4)[0] == 1  # step 1: version 1's copy, to both
    version, values = world.take(1, 4)
    assert version == 3 and values == [3.0] * 4  # step 2: the updates of version 3, sent once free
    server.snapshots.wait_all()


def test_a_refused_pull_is_answered_with_no_copy():
    server = _server(workers=1, staleness=2, budget=1)
    _pull(server, 0, 0)
    _push(server, 0, 0)
    _pull(server, 0, 1)  # the budget is spent: -1 and an empty PARAMS message
    world = server.world
    assert world.take(1, 4)[0] == 0
    version, values = world.take(1, 4)
    assert version == -1 and values == [] and server.granted == 1
    MPI.Request.Waitall([r for r, _ in server._refusals])
    server.snapshots.wait_all()
