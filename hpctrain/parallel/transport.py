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

import queue
import threading

import numpy as np

__all__ = ["CommThread", "Transport", "PointToPoint", "TAG_LIMIT"]

TAG_LIMIT = 32767  # the smallest MPI_TAG_UB the standard allows


class Transport:
    """How arrays of ``backend`` reach MPI: ``direct`` (as they are) or staged through host memory."""

    def __init__(self, backend, *, cuda_aware: bool):
        self.backend = backend
        self.direct = (not backend.is_device) or bool(cuda_aware)
        self._staging = {}  # (shape, dtype) -> a pinned buffer for the blocking collectives (``collective_buffer``)

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

    def incoming_queued(self, host, arr):
        """After MPI wrote ``host`` (staged): its copy into ``arr`` queued on the training stream, in order with
        the kernels that read ``arr``; returns the event (``backend.mark``) after which ``host`` may be written
        again, or None when MPI wrote ``arr`` itself. The host does not wait."""
        if self.direct:
            return None
        self.backend.copy_(arr, host)
        return self.backend.mark()

    def incoming_async(self, host, arr):
        """After MPI wrote ``host`` (staged): its copy into ``arr`` queued on the copy stream; returns the event
        the training thread's stream must wait for (``backend.after``), or None when MPI wrote ``arr`` itself."""
        return None if self.direct else self.backend.stage_in(host, arr)

    def collective_buffer(self, arr):
        """What a blocking collective over ``arr`` should pass MPI: ``arr`` itself (waited for on a device), or a
        pinned host copy of it in a staging buffer kept per shape (a tensor-parallel Allreduce, a tied tensor's sum
        or refresh: no allocation per call). Reusing it is safe: the copy back (``collective_done``) is queued on
        the stream before the next call's copy out, which waits for the stream."""
        if self.direct:
            return self.outgoing(arr)
        key = (tuple(arr.shape), str(arr.dtype))
        if key not in self._staging:
            self._staging[key] = self.backend.pinned_host(arr.shape, arr.dtype)
        return self.outgoing(arr, self._staging[key])

    def collective_done(self, buf, arr) -> None:
        """After the collective wrote ``buf`` (from ``collective_buffer``): its copy into ``arr`` queued, if staged."""
        if buf is not arr:
            self.backend.copy_(arr, buf)

    def allreduce_(self, comm, arr) -> None:
        """Sum ``arr`` over ``comm`` in place (a blocking Allreduce; collective over ``comm``)."""
        from mpi4py import MPI

        buf = self.collective_buffer(arr)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        self.collective_done(buf, arr)


class CommThread:
    """A daemon thread that runs submitted MPI work (a bucket's collective, a send), one at a time, in order.

    Only this thread uses what it is handed while work is in flight; ``join`` waits for all of it and re-raises
    the thread's error, if any. ``on_start`` runs first on the thread (a device backend's ``bind_thread``).
    Needs MPI_THREAD_MULTIPLE: the caller's thread goes on calling MPI meanwhile.
    """

    def __init__(self, name: str, on_start=None):
        self.queue = queue.Queue()
        self.error = None
        self.on_start = on_start
        self.submitted = 0  # pieces of work handed over, and finished (or skipped after an error)
        self._done = 0
        self._finished = threading.Condition()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, work) -> None:
        self.submitted += 1
        self.queue.put(work)

    def wait_done(self, count: int) -> None:
        """Wait until the first ``count`` pieces of work submitted are finished (the thread's error, if one came,
        is for ``join`` to raise)."""
        with self._finished:
            self._finished.wait_for(lambda: self._done >= count)

    def close(self) -> None:
        """Stop the thread once what was submitted is done."""
        self.queue.put(None)

    @staticmethod
    def stop(thread: CommThread | None) -> None:
        """Close an owner's thread, if it has one (not collective); None, for the owner to hold from now on:
        ``self._worker = CommThread.stop(self._worker)``."""
        if thread is not None:
            thread.close()

    def _run(self):
        try:
            if self.on_start is not None:
                self.on_start()
        except BaseException as e:  # every piece of work is then skipped; join() raises it
            self.error = e
        while True:
            work = self.queue.get()
            if work is None:
                self.queue.task_done()
                return
            try:
                if self.error is None:
                    work()
            except BaseException as e:  # handed to the caller's thread in join()
                self.error = e
            finally:
                work = None  # what it held (a sent array) is not kept by this frame until the next piece comes
                with self._finished:
                    self._done += 1
                    self._finished.notify_all()
                self.queue.task_done()

    def join(self) -> None:
        self.queue.join()
        if self.error is not None:
            raise self.error


class _Recv:
    __slots__ = ("request", "host", "arr", "transport", "check", "uploaded")

    def __init__(self, request, host, arr, transport, check=None):
        self.request, self.host, self.arr, self.transport, self.check = request, host, arr, transport, check
        self.uploaded = None  # staged: the event after which ``host`` is free again (the copy into ``arr``)

    def wait(self):
        """Complete the receive; returns the backend array holding the message (staged: its copy into the array is
        queued, in order with the kernels that read it; ``uploaded`` says when the host buffer is free)."""
        if self.check is not None:
            self.check(self.request)
        else:
            self.request.Wait()
        if self.host is not None:
            self.uploaded = self.transport.incoming_queued(self.host, self.arr)
        return self.arr


class PointToPoint:
    """``Isend``/``Irecv`` of backend arrays over ``comm``; sends stay referenced until they complete.

    On a device (with MPI_THREAD_MULTIPLE, and without collective diagnostics) a sender thread posts the sends:
    the training thread records an event for the array and goes on queueing kernels, the sender waits for the
    event, stages the array into a pinned buffer of its pool on the copy stream (or hands device memory to a
    CUDA-aware MPI) and posts the ``Isend``.
    """

    def __init__(self, *, comm, transport: Transport, max_in_flight: int = 4, diag=None):
        from mpi4py import MPI

        self.comm, self.transport = comm, transport
        self.max_in_flight = max_in_flight
        self._sends = []  # (request, buffer, pooled host buffer or None): MPI may read the buffer until completion
        self.diag = diag  # parallel/watch.py's Diagnostics, or None
        self._fp = comm.Dup() if diag is not None and diag.fingerprints else None
        self._counts = {}  # ("send" | "recv", peer, tag) -> messages so far
        be = transport.backend
        threaded = be.is_device and diag is None and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._sender = CommThread("hpctrain-p2p-send", on_start=be.bind_thread) if threaded else None
        self._pool = {}  # (shape, dtype) -> free pinned host buffers for staged sends

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
        ``max_in_flight`` sends stay in flight: beyond that the oldest is waited for). ``arr`` must not be
        written again before the step's ``wait_sends`` (the executor sends each array once and drops it)."""
        if self._sender is not None:
            self.transport.backend.lend(arr)  # held by the sender thread until sent, at most to the step's end
            ready = self.transport.backend.mark()  # what writes ``arr`` is queued before this point
            self._sender.submit(lambda: self._send_when(arr, dest, tag, ready))
            return
        self._isend(self.transport.outgoing(arr), dest, tag, None)

    def _send_when(self, arr, dest: int, tag: int, ready) -> None:
        """On the sender thread: ``arr`` once ``ready`` is done, staged through a pooled pinned buffer or direct."""
        host = None
        if not self.transport.direct:
            free = self._pool.setdefault((tuple(arr.shape), np.dtype(arr.dtype).str), [])
            host = free.pop() if free else self.transport.backend.pinned_host(arr.shape, arr.dtype)
        self._isend(self.transport.outgoing_when(arr, host, ready), dest, tag, host)

    def _isend(self, buf, dest: int, tag: int, host) -> None:
        if self._fp is not None:
            from .watch import pack_record, call_site

            record = pack_record(f"{self._key('send', dest, tag, buf)}|{call_site(3)}")
            self._sends.append((self._fp.Isend(record, dest=dest, tag=tag % TAG_LIMIT), record, None))
        self._sends.append((self.comm.Isend(buf, dest=dest, tag=tag % TAG_LIMIT), buf, host))
        # backpressure: a stage that never waits (stage 0 of a forward-only pass) would otherwise keep
        # every activation it sent alive until the end; waiting on an older send than the schedule checker
        # already assumed complete cannot deadlock
        while len(self._sends) > self.max_in_flight * (2 if self._fp is not None else 1):
            request, _, pooled = self._sends.pop(0)
            self._wait(request, f"send to rank {dest}")
            self._give_back(pooled)

    def _give_back(self, host) -> None:
        if host is not None:
            self._pool[(tuple(host.shape), np.dtype(host.dtype).str)].append(host)

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
        """Let MPI move the sends in flight along, and drop those that completed (the sender thread's own, when
        there is one: MPI's progress comes with the receives' waits)."""
        if self._sends and self._sender is None:
            from mpi4py import MPI

            done = MPI.Request.Testsome([r for r, _, _ in self._sends])
            if done:
                finished = set(done)
                self._sends = [s for i, s in enumerate(self._sends) if i not in finished]

    def wait_sends(self) -> None:
        """Complete every send in flight (their receivers have posted them by the schedule's construction)."""
        if self._sender is not None:
            self._sender.join()  # every send posted; the thread is idle from here on
        if self._sends:
            from mpi4py import MPI

            if self.diag is None:
                MPI.Request.Waitall([r for r, _, _ in self._sends])
            else:
                for request, _, _ in self._sends:
                    self._wait(request, "completing this stage's sends")
            for _, _, host in self._sends:
                self._give_back(host)
            self._sends = []

    def free(self) -> None:
        """Free the fingerprints' duplicate communicator (collective over ``comm``) and stop the sender thread."""
        self._sender = CommThread.stop(self._sender)
        if self._fp is not None:
            self._fp.Free()
            self._fp = None
