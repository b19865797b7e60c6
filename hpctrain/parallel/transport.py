"""Backend arrays to MPI: straight from device memory when MPI is CUDA-aware, else through host staging.

One place decides how a backend array reaches MPI, for the gradient sync and for the
pipeline's point-to-point messages alike:

* host arrays (the CPU backend), and device arrays under a CUDA-aware MPI, go to MPI as
  they are; the producing stream is synchronised first, because MPI reads the memory
  directly;
* otherwise a device array is copied into a host buffer before a send and out of one
  after a receive.

On the training thread ``outgoing``/``incoming`` wait for the device. A communication
thread uses ``outgoing_when``/``incoming_async`` instead: it waits for an event the
training thread recorded (``backend.mark()``) and stages on the backend's copy stream,
and the copy back returns an event that the training thread's stream waits for on the
device (``backend.after``), so the training thread never waits for the device there.

``PointToPoint`` wraps ``Isend``/``Irecv`` on one communicator (the mesh's ``pp_comm``:
stage s is rank s there). With collective diagnostics on (parallel/watch.py) each send
is preceded by its fingerprint on a duplicate communicator, which the receiver checks
before it takes the data, and every wait is recorded for the watchdog. Which ranks must call what is the schedule's business: the
pipeline executor posts each receive before its sender needs it, and a schedule that
could leave a send without its receive is refused at start-up (parallel/schedule.py).
"""

from __future__ import annotations

import numpy as np

__all__ = ["Transport", "PointToPoint", "TAG_LIMIT"]

TAG_LIMIT = 32767  # the smallest MPI_TAG_UB the standard allows


class Transport:
    """How arrays of ``backend`` reach MPI: ``direct`` (as they are) or staged through host memory."""

    def __init__(self, backend, *, cuda_aware: bool):
        self.backend = backend
        self.direct = (not backend.is_device) or bool(cuda_aware)

    def host_buffer(self, shape):
        """A host buffer to stage arrays of ``shape`` through (None when arrays go to MPI directly)."""
        return None if self.direct else self.backend.pinned_host(shape)

    def outgoing(self, arr, host=None):
        """What MPI should read to send ``arr``: ``arr`` itself, or ``host`` (or a new host copy) holding it."""
        if self.direct:
            if self.backend.is_device:
                self.backend.synchronize()  # MPI reads the device memory itself
            return arr
        if host is None:
            return self.backend.to_host(arr)
        self.backend.to_host_into(arr, host)
        return host

    def incoming(self, host, arr) -> None:
        """After MPI wrote ``host`` (staged), copy it into ``arr``; nothing to do when direct."""
        if not self.direct:
            self.backend.from_host_into(host, arr)

    def outgoing_when(self, arr, host, ready):
        """On a communication thread: what MPI should read to send ``arr`` once ``ready`` (``backend.mark()``,
        recorded when ``arr`` was written) is done: ``arr`` after a wait for the event, or ``host`` holding it
        (copied on the copy stream)."""
        if self.direct:
            self.backend.host_wait_for(ready)  # MPI reads the device memory itself
            return arr
        self.backend.stage_out(arr, host, ready)
        return host

    def incoming_async(self, host, arr):
        """After MPI wrote ``host`` (staged): its copy into ``arr`` queued on the copy stream; returns the event
        the training thread's stream must wait for (``backend.after``), or None when MPI wrote ``arr`` itself."""
        return None if self.direct else self.backend.stage_in(host, arr)

    def allreduce_(self, comm, arr) -> None:
        """Sum ``arr`` over ``comm`` in place (a blocking Allreduce; collective over ``comm``)."""
        from mpi4py import MPI

        buf = self.outgoing(arr)  # the array itself (host, or CUDA-aware MPI) or a host copy
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        if buf is not arr:
            self.backend.copy_(arr, self.backend.asarray(buf).reshape(arr.shape))


class _Recv:
    __slots__ = ("request", "host", "arr", "transport", "check")

    def __init__(self, request, host, arr, transport, check=None):
        self.request, self.host, self.arr, self.transport, self.check = request, host, arr, transport, check

    def wait(self):
        """Complete the receive; returns the backend array holding the message."""
        if self.check is not None:
            self.check(self.request)
        else:
            self.request.Wait()
        if self.host is not None:
            self.transport.incoming(self.host, self.arr)
        return self.arr


class PointToPoint:
    """``Isend``/``Irecv`` of backend arrays over ``comm``; sends stay referenced until they complete."""

    def __init__(self, *, comm, transport: Transport, max_in_flight: int = 4, diag=None):
        self.comm, self.transport = comm, transport
        self.max_in_flight = max_in_flight
        self._sends = []  # (request, buffer): MPI may read the buffer until the request completes
        self.diag = diag  # parallel/watch.py's Diagnostics, or None
        self._fp = comm.Dup() if diag is not None and diag.fingerprints else None
        self._counts = {}  # ("send" | "recv", peer, tag) -> messages so far

    def post_recv(self, arr, *, source: int, tag: int, host=None) -> _Recv:
        """Post a receive into ``arr`` (through ``host`` when staged); ``wait()`` on the result completes it."""
        buf = arr if self.transport.direct else host
        request = self.comm.Irecv(buf, source=source, tag=tag % TAG_LIMIT)
        check = None
        if self.diag is not None:
            check = self._recv_check(buf, source, tag)
        return _Recv(request, None if self.transport.direct else host, arr, self.transport, check)

    def post_send(self, arr, *, dest: int, tag: int) -> None:
        """Start sending ``arr``; the buffer is kept alive until the send completes (at most
        ``max_in_flight`` sends stay in flight: beyond that the oldest is waited for)."""
        buf = self.transport.outgoing(arr)
        if self._fp is not None:
            from .watch import pack_record, call_site

            record = pack_record(f"{self._key('send', dest, tag, buf)}|{call_site(2)}")
            self._sends.append((self._fp.Isend(record, dest=dest, tag=tag % TAG_LIMIT), record))
        self._sends.append((self.comm.Isend(buf, dest=dest, tag=tag % TAG_LIMIT), buf))
        # backpressure: a stage that never waits (stage 0 of a forward-only pass) would otherwise keep
        # every activation it sent alive until the end; waiting on an older send than the schedule checker
        # already assumed complete cannot deadlock
        while len(self._sends) > self.max_in_flight * (2 if self._fp is not None else 1):
            request, _ = self._sends.pop(0)
            self._wait(request, f"send to rank {dest}")

    def _key(self, direction: str, peer: int, tag: int, buf) -> str:
        """What both ends of a message must agree on: its number among the two ranks' messages with its tag
        (counted per tag, so receives posted in another order than the sends still agree), dtype and size."""
        from .watch import describe_buffer

        key = (direction, peer, tag % TAG_LIMIT)
        n = self._counts[key] = self._counts.get(key, 0) + 1
        return f"message #{n} tag {tag % TAG_LIMIT} {describe_buffer(buf)}"

    def _recv_check(self, buf, source: int, tag: int):
        """The wait of a receive under diagnostics: recorded, and (fingerprints) checked against the sender's."""
        from .watch import RECORD, unpack_record, call_site, end_job

        site = call_site(3)
        expected = self._key("recv", source, tag, buf) if self._fp is not None else ""
        record = np.zeros(RECORD, dtype=np.uint8) if self._fp is not None else None
        fp_request = self._fp.Irecv(record, source=source, tag=tag % TAG_LIMIT) if record is not None else None

        def wait(request):
            what = f"receive of {expected or f'tag {tag}'} from rank {source} at {site}"
            if fp_request is not None:
                self._wait(fp_request, what)
                sent, sent_at = unpack_record(record).split("|", 1)
                if sent != expected:
                    end_job(f"debug_collectives: rank {self.comm.Get_rank()} of {getattr(self.comm, '_name', 'pp')} "
                            f"expected {expected} from rank {source} at {site}; it sent {sent} at {sent_at}")
            self._wait(request, what)

        return wait

    def _wait(self, request, what: str) -> None:
        if self.diag is None:
            request.Wait()
            return
        self.diag.begin(what)
        try:
            request.Wait()
        finally:
            self.diag.end()

    def progress(self) -> None:
        """Let MPI move the sends in flight along, and drop those that completed."""
        if self._sends:
            from mpi4py import MPI

            done = MPI.Request.Testsome([r for r, _ in self._sends])
            if done:
                finished = set(done)
                self._sends = [s for i, s in enumerate(self._sends) if i not in finished]

    def wait_sends(self) -> None:
        """Complete every send in flight (their receivers have posted them by the schedule's construction)."""
        if self._sends:
            from mpi4py import MPI

            if self.diag is None:
                MPI.Request.Waitall([r for r, _ in self._sends])
            else:
                for request, _ in self._sends:
                    self._wait(request, "completing this stage's sends")
            self._sends = []

    def free(self) -> None:
        """Free the fingerprints' duplicate communicator (collective over ``comm``)."""
        if self._fp is not None:
            self._fp.Free()
            self._fp = None
