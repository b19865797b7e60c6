"""An asynchronous parameter server with bounded staleness (stale synchronous parallel).

The first S ranks of the world serve, the other W work. The global flat parameter buffer
is cut into S contiguous ranges (``server_ranges``); server s owns range s, its optimizer
state, and applies updates to it. Worker w trains the whole model on its share of every
global batch (data-parallel rank w of W) and talks to every server with buffer-based
point-to-point messages, no pickle:

    worker                                   server s
    PULL   int64 [clock, stop]        ──▶    held until the bound allows it, then
           int64 [version]            ◀──    VERSION (−1: stop) and
           float32 params[range s]    ◀──    PARAMS
    PUSH   float64 [clock, version, loss, rows]  ──▶
           float32 grads[range s]     ──▶    GRAD: applied in arrival order
    DONE   float64 [idle seconds, steps] ──▶ after it was told to stop

A worker sends the PULL for step c + 1 before it computes step c (``WorkerLink.request``),
so the servers' answer travels while it computes. ``clock`` counts the pushes a worker
has made. A PULL for clock c is answered once every worker has pushed at least c − k
gradients (k = ``staleness``), so no worker is ever more than k steps ahead of the
slowest. With k = 0 a server also waits for the W gradients of step c − 1 and applies
their sum as one update: synchronous data-parallel training on the same global batch.
With k > 0 each gradient is one update, applied as it arrives (the parameters a worker
computes step c + 1 on may lack its own gradient of step c); the server records its
staleness, the updates applied since the parameters it was computed on were sent.

The step budget is global: a run computes (steps − start) · W gradients, whichever
workers compute them, so a fast worker takes more steps than a slow one (up to the
bound). The first server counts the PULLs it answers with parameters and answers −1
once the budget is spent; a worker stops when any server says −1 and pushes only
gradients every server granted, so every server applies the same gradients. A worker
that sent DONE no longer counts for the bound. Only the first server's budget and a
stop request (a signal: the stop flag of a PULL, or this server's own) answer −1, so
a server never refuses a pull the first server granted (that gradient would be lost
and the run would end one short of its budget).

Ordering: MPI keeps messages between two ranks on one communicator and tag in order,
and a worker sends PUSH before GRAD, so a server that receives a PUSH header then
receives its gradient from the same worker. A server answers a PULL with non-blocking
sends of a copy of its range (``_Snapshots``), which stays alive until every send of it
completes: that is when its worker waits for it, after computing the step it asked
ahead for, so with one copy per version W workers kept about W copies. At most
``SNAPSHOTS`` (2) are alive, whatever W and k: a pull takes this version's copy, else a
new one while fewer are alive, else (k > 0) the newest one if it already holds every
worker's first c − k gradients (what the bound promises a pull for clock c; the version
sent is that copy's, so the recorded staleness counts the updates it lacks), else it
waits, and the server goes on receiving and applying gradients until a copy's sends
complete. A refusal (−1) sends no copy: an empty PARAMS message. So a server's memory
does not grow with the number of workers. A run ends when every worker has sent DONE to
every server: nothing is left unmatched.

Collective behaviour: ``Server.run`` and ``WorkerLink`` calls are point-to-point; with
k = 0 and S > 1 the servers Allreduce the gradient norm² over ``servers_comm`` for each
update, every server for the same step.
"""

from __future__ import annotations

import collections
import time

import numpy as np

__all__ = ["server_ranges", "Server", "WorkerLink", "TAGS"]

TAGS = dict(PULL=11, VERSION=12, PARAMS=13, PUSH=14, GRAD=15, DONE=16)
SNAPSHOTS = 2  # the most copies of its range a server keeps for answers in flight, whatever W and the staleness


def server_ranges(total: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges of a flat buffer of ``total`` values, as even as can be."""
    return [(total * s // servers, total * (s + 1) // servers) for s in range(servers)]


class Server:
    """Server rank ``rank`` (< S) of the world: its range's parameters, optimizer and the staleness bound.

    ``optimizer(grad, version, sum_norm=)`` applies one update to ``params`` (the range's host array) with
    the gradient ``grad``: ``grads`` (the optimizer's gradient array, which gradients are received into)
    for k > 0, the sum of the step's gradients for k = 0 (``sum_norm``: clipped by the norm over the servers).
    """

    def __init__(self, *, world, servers_comm, workers: int, staleness: int, params: np.ndarray, grads: np.ndarray,
                 optimizer,
                 start: int = 0, budget: int | None = None, stop_flag=None, log=None):
        self.world, self.servers_comm, self.W, self.k = world, servers_comm, workers, staleness
        self.S = servers_comm.Get_size()
        self.params, self.grads, self.optimizer, self.stop_flag = params, grads, optimizer, stop_flag
        self.log = log or (lambda *a: None)
        self.start = start  # the step a resumed run starts from: every worker's first clock
        self.budget = budget  # the first server only: the gradients this run may compute (None: no limit)
        self.granted = 0  # pulls answered with parameters: each is one gradient to come
        self.pushes = [start] * workers  # each worker's clock: the steps it has pushed a gradient for
        self.version = 0  # updates applied (by this run)
        self.stopping = False
        self.done = set()  # workers that sent DONE
        self.staleness = []  # per applied gradient (k > 0) or 0 (k = 0)
        self.loss_sum = self.rows = 0.0  # since the last take_loss()
        self.idle = [0.0] * workers
        self.steps = [0] * workers
        self._pending = []  # (worker, clock) pulls not answered yet
        self._deferred = False  # a pending pull the bound lets go waits for a copy of the range to send
        self.snapshots = _Snapshots(limit=SNAPSHOTS)  # what the answers send, until their sends complete
        self._refusals = []  # (request, buffer) of the answers that said stop
        self._sum = np.zeros_like(params) if staleness == 0 else None  # k = 0: the W gradients of this step
        self._sum_count = 0
        self.ahead_max = 0  # the most steps a worker was ahead of the slowest when let go (<= staleness)

    def worker_rank(self, w: int) -> int:
        return self.S + w

    def run(self, on_update=None) -> None:
        """Serve until every worker has sent DONE; ``on_update(version)`` after each update."""
        from mpi4py import MPI

        done, status = 0, MPI.Status()
        grad = self.grads
        self.started = time.perf_counter()
        while done < self.W:
            if not self._wait_for_message(status):
                self._answer()  # a copy of the range was freed: a deferred pull can be answered
                continue
            src, tag = status.Get_source(), status.Get_tag()
            w = src - self.S
            if tag == TAGS["PULL"]:
                head = np.empty(2, dtype=np.int64)
                self.world.Recv(head, source=src, tag=tag)
                self.stopping |= bool(head[1])
                self._pending.append((w, int(head[0])))
            elif tag == TAGS["PUSH"]:
                head = np.empty(4, dtype=np.float64)
                self.world.Recv(head, source=src, tag=tag)
                self.world.Recv(grad, source=src, tag=TAGS["GRAD"])
                self.loss_sum += head[2]
                self.rows += head[3]
                self._apply(w, int(head[1]), grad, on_update)
            elif tag == TAGS["DONE"]:
                tail = np.empty(2, dtype=np.float64)
                self.world.Recv(tail, source=src, tag=tag)
                self.idle[w], self.steps[w] = float(tail[0]), int(tail[1])
                self.done.add(w)  # no longer holds the others back; they are told to stop by the first server
                done += 1
            else:
                raise RuntimeError(f"parameter server {self.world.Get_rank()}: unexpected message tag {tag} "
                                   f"from rank {src}")
            if self.stop_flag is not None and self.stop_flag():
                self.stopping = True
            self._answer()
        self.snapshots.wait_all()
        MPI.Request.Waitall([r for r, _ in self._refusals])
        self._refusals = []
        self.elapsed = time.perf_counter() - self.started

    def _wait_for_message(self, status) -> bool:
        """Until a message arrives (True), or a copy of the range is freed while a pull waits for one (False):
        polling, then sleeping in growing steps (to 1 ms), so that an idle server leaves its core to the
        workers (a blocking Probe spins it, which on a node with more ranks than cores slows every worker
        down)."""
        from mpi4py import MPI

        pause = 0.0
        while not self.world.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            if self._deferred and self.snapshots.reap():
                return False
            if pause:
                time.sleep(pause)
            pause = min(1e-3, max(2e-5, pause * 2))
        return True

    def _apply(self, w: int, version_read: int, grad: np.ndarray, on_update) -> None:
        self.pushes[w] += 1
        if self.k == 0:  # one update from the W gradients of this step, as synchronous data parallelism
            self._sum += grad
            self._sum_count += 1
            if self._sum_count < self.W:
                return
            self.optimizer(self._sum, self.version, sum_norm=True)
            self._sum[:] = 0.0
            self._sum_count = 0
            self.staleness.append(0)
        else:
            self.staleness.append(self.version - version_read)
            self.optimizer(grad, self.version, sum_norm=False)
        self.version += 1
        if on_update is not None:
            on_update(self.version)

    def _answer(self) -> None:
        """Send the parameters to each waiting worker the staleness bound now lets go on (and a copy of the
        range can be sent to: else it waits, ``_deferred``, while the server goes on applying gradients)."""
        active = [p for w, p in enumerate(self.pushes) if w not in self.done]
        slowest = min(active, default=max(self.pushes))  # the bound is over the workers still training
        still, self._deferred = [], False
        for w, clock in self._pending:
            stop = self.stopping or (self.budget is not None and self.granted >= self.budget)
            ready = stop or (slowest >= clock - self.k and (self.k > 0 or self.start + self.version == clock))
            if not ready:
                still.append((w, clock))
                continue
            dest = self.worker_rank(w)
            if stop:  # nothing to compute on: an empty PARAMS message matches the worker's receive, no copy
                version = np.array([-1], dtype=np.int64)
                self._refusals += [(self.world.Isend(version, dest=dest, tag=TAGS["VERSION"]), version),
                                   (self.world.Isend(_EMPTY, dest=dest, tag=TAGS["PARAMS"]), None)]
                continue
            # the update may change params while the send is in flight: a copy, shared (k > 0: a copy that
            # already holds every worker's first clock - k gradients, which the bound promises this pull)
            answer = self.snapshots.answer(self.version, slowest, self.params,
                                           needs=clock - self.k if self.k > 0 else None)
            if answer is None:  # every copy is still being sent and none will do: wait for one to be free
                still.append((w, clock))
                self._deferred = True
                continue
            sent, data = answer
            self.ahead_max = max(self.ahead_max, clock - slowest)
            self.granted += 1
            version = np.array([sent], dtype=np.int64)
            self.snapshots.sent(sent, self.world.Isend(version, dest=dest, tag=TAGS["VERSION"]), version)
            self.snapshots.sent(sent, self.world.Isend(data, dest=dest, tag=TAGS["PARAMS"]))
        self._pending = still


_EMPTY = np.empty(0, dtype=np.float32)


class _Snapshots:
    """Host copies of a server's range as sent to the workers, at most ``limit`` alive whatever the number of
    workers or the staleness. A copy stays until every send of it completes, which is when each worker it was
    sent to waits for it (after computing the step it asked ahead for): with one copy per version, W workers
    kept up to W copies alive. ``answer`` shares a copy: this version's if there is one, else a new one while
    fewer than ``limit`` are alive, else the newest one if it holds what the pull needs (k > 0), else none
    (the pull waits; ``reap`` frees the copies whose sends completed). ``peak``: the most alive at once."""

    def __init__(self, limit: int = 2):
        self.limit = max(1, limit)
        self._live = collections.OrderedDict()  # version -> (copy, floor, [(request, buffer kept alive)])
        self.peak = 0

    def answer(self, version: int, floor: int, params: np.ndarray, needs: int | None):
        """``(version sent, copy)`` for a pull, or None. ``floor``: every worker has pushed at least this many
        gradients into ``params`` (the slowest's clock); ``needs``: the floor a copy of an older version must
        have for this pull (None: only this version will do)."""
        entry = self._live.get(version)
        if entry is None and len(self._live) >= self.limit:
            self.reap()
        if entry is None and len(self._live) < self.limit:
            entry = self._live[version] = (params.copy(), floor, [])
            self.peak = max(self.peak, len(self._live))
        if entry is not None:
            return version, entry[0]
        newest = next(reversed(self._live))
        copy, have, _ = self._live[newest]
        return (newest, copy) if needs is not None and have >= needs else None

    def sent(self, version: int, request, keep=None) -> None:
        """Record a send of ``version``'s copy (``keep``: a buffer that must live until it completes)."""
        self._live[version][2].append((request, keep))

    def reap(self) -> bool:
        """Drop every copy whose sends have completed (at most ``limit`` are tested); whether any went."""
        from mpi4py import MPI

        gone = [v for v, (_, _, sends) in self._live.items() if MPI.Request.Testall([r for r, _ in sends])]
        for v in gone:
            del self._live[v]
        return bool(gone)

    def wait_all(self) -> None:
        from mpi4py import MPI

        for _, _, sends in self._live.values():
            MPI.Request.Waitall([r for r, _ in sends])
        self._live.clear()

    def __len__(self) -> int:
        return len(self._live)


class WorkerLink:
    """A worker's side: ``request`` the parameters of a step, ``receive`` them, ``push`` a gradient, ``done``.

    ``request`` only posts the PULL and the receives, so a worker asks for the next step's parameters before it
    computes this step's gradient: the servers answer while it computes, and no round trip to a server sits on
    the worker's critical path. With staleness 0 the servers hold the answer until the step's update is made.
    """

    def __init__(self, *, world, ranges, servers: int):
        self.world, self.ranges, self.S = world, ranges, servers
        self._sends = []
        self._recvs = []
        self._versions = np.empty((servers, 1), dtype=np.int64)
        self.idle = 0.0

    def request(self, clock: int, into: np.ndarray, stop: bool) -> None:
        """Ask every server for the parameters of step ``clock``; they arrive in ``into`` (the full host array)."""
        self._wait_sends()  # the gradient buffers of the last push may be reused once this returns
        head = np.array([clock, int(stop)], dtype=np.int64)
        for s in range(self.S):
            self.world.Send(head, dest=s, tag=TAGS["PULL"])
        for s, (lo, hi) in enumerate(self.ranges):
            self._recvs.append(self.world.Irecv(self._versions[s], source=s, tag=TAGS["VERSION"]))
            self._recvs.append(self.world.Irecv(into[lo:hi], source=s, tag=TAGS["PARAMS"]))

    def receive(self) -> int | None:
        """Wait for the requested parameters; their version (the smallest of the servers'), or None when a
        server says stop (the step budget is spent, or a signal)."""
        from mpi4py import MPI

        t0 = time.perf_counter()
        MPI.Request.Waitall(self._recvs)
        self._recvs = []
        self.idle += time.perf_counter() - t0
        version = int(self._versions.min())
        return None if version < 0 else version

    def push(self, clock: int, version: int, grads: np.ndarray, loss_sum: float, rows: int) -> None:
        """Send the gradient (host array) to the servers, each its range; non-blocking."""
        for s, (lo, hi) in enumerate(self.ranges):
            head = np.array([clock, version, loss_sum if s == 0 else 0.0, rows if s == 0 else 0], dtype=np.float64)
            self._sends.append((self.world.Isend(head, dest=s, tag=TAGS["PUSH"]), head))
            self._sends.append((self.world.Isend(grads[lo:hi], dest=s, tag=TAGS["GRAD"]), grads))

    def done(self, steps: int) -> None:
        self._wait_sends()
        tail = np.array([self.idle, steps], dtype=np.float64)
        for s in range(self.S):
            self.world.Send(tail, dest=s, tag=TAGS["DONE"])

    def _wait_sends(self) -> None:
        if self._sends:
            from mpi4py import MPI

            MPI.Request.Waitall([r for r, _ in self._sends])
            self._sends = []
