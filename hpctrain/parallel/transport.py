"""Backend arrays to MPI: straight from device memory when MPI is CUDA-aware, else through host staging.

One place decides how a backend array reaches MPI, for the gradient sync and for the
pipeline's point-to-point messages alike:

* host arrays (the CPU backend), and device arrays under a CUDA-aware MPI, go to MPI as
  they are; the producing stream is synchronised first, because MPI reads the memory
  directly;
* otherwise a device array is copied into a host buffer before a send and out of one
  after a receive.

``PointToPoint`` wraps ``Isend``/``Irecv`` on one communicator (the mesh's ``pp_comm``:
stage s is rank s there). Which ranks must call what is the schedule's business: the
pipeline executor posts each receive before its sender needs it, and a schedule that
could leave a send without its receive is refused at start-up (parallel/schedule.py).
"""

from __future__ import annotations

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

    def allreduce_(self, comm, arr) -> None:
        """Sum ``arr`` over ``comm`` in place (a blocking Allreduce; collective over ``comm``)."""
        from mpi4py import MPI

        buf = self.outgoing(arr)  # the array itself (host, or CUDA-aware MPI) or a host copy
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        if buf is not arr:
            self.backend.copy_(arr, self.backend.asarray(buf).reshape(arr.shape))


class _Recv:
    __slots__ = ("request", "host", "arr", "transport")

    def __init__(self, request, host, arr, transport):
        self.request, self.host, self.arr, self.transport = request, host, arr, transport

    def wait(self):
        """Complete the receive; returns the backend array holding the message."""
        self.request.Wait()
        if self.host is not None:
            self.transport.incoming(self.host, self.arr)
        return self.arr


class PointToPoint:
    """``Isend``/``Irecv`` of backend arrays over ``comm``; sends stay referenced until they complete."""

    def __init__(self, *, comm, transport: Transport, max_in_flight: int = 4):
        self.comm, self.transport = comm, transport
        self.max_in_flight = max_in_flight
        self._sends = []  # (request, buffer): MPI may read the buffer until the request completes

    def post_recv(self, arr, *, source: int, tag: int, host=None) -> _Recv:
        """Post a receive into ``arr`` (through ``host`` when staged); ``wait()`` on the result completes it."""
        buf = arr if self.transport.direct else host
        return _Recv(self.comm.Irecv(buf, source=source, tag=tag % TAG_LIMIT), None if self.transport.direct else host,
                     arr, self.transport)

    def post_send(self, arr, *, dest: int, tag: int) -> None:
        """Start sending ``arr``; the buffer is kept alive until the send completes (at most
        ``max_in_flight`` sends stay in flight: beyond that the oldest is waited for)."""
        buf = self.transport.outgoing(arr)
        self._sends.append((self.comm.Isend(buf, dest=dest, tag=tag % TAG_LIMIT), buf))
        # backpressure: a stage that never waits (stage 0 of a forward-only pass) would otherwise keep
        # every activation it sent alive until the end; waiting on an older send than the schedule checker
        # already assumed complete cannot deadlock
        while len(self._sends) > self.max_in_flight:
            request, _ = self._sends.pop(0)
            request.Wait()

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

            MPI.Request.Waitall([r for r, _ in self._sends])
            self._sends = []
