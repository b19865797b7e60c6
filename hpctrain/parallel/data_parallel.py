"""Bucketed, overlapped gradient Allreduce over the data-parallel communicator.

    mpiexec -n 2 hpctrain train jobs/configs/digits.toml

Gradients live in one flat buffer; a bucket is a contiguous slice of it of
about ``bucket_mb`` megabytes. Buckets are cut from the end of the buffer,
because the backward pass writes the last layer's gradients first. With
``overlap = true`` a bucket's ``Iallreduce`` starts as soon as the backward
pass has made its lowest gradient final (the model part's "gradients final
from offset lo" event, raised during the step's last backward; at most one
new bucket per event; ``Testall`` at each event drives their progress); ``wait()``
(before the optimizer step) reduces the buckets not yet started with
blocking ``Allreduce`` calls and waits for the rest. With ``overlap = false`` one ``Allreduce`` over
the whole buffer runs after backward.

Collective calls: ``start_step``/``grads_final``/``wait`` must be called by every
rank of the data-parallel group in the same order for every step, with the
same layout (checked at start-up). A rank that stops calling them leaves the
others waiting; the CLI turns any rank's exception into ``COMM_WORLD.Abort``.

The 1/dp of the average is applied once, folded into the loss gradient's
scale (1 / global batch), so the Allreduce is a plain sum and costs no extra
pass over the buffer.

Device buffers go to MPI directly when MPI is CUDA-aware; otherwise each
bucket is staged through a host buffer. parallel/transport.py decides which.
"""

from __future__ import annotations

import queue
import threading
import time

__all__ = ["GradSync", "make_buckets"]


def make_buckets(size: int, bucket_elems: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) slices of a buffer of ``size`` elements, cut from the end."""
    bucket_elems = max(1, int(bucket_elems))
    buckets, hi = [], size
    while hi > 0:
        lo = max(0, hi - bucket_elems)
        buckets.append((lo, hi))
        hi = lo
    return buckets


class GradSync:
    """Sum the gradient buffer over ``comm`` in buckets, overlapped with backward when asked.

    Every rank must issue the same collectives in the same order, so what is
    started when depends only on the "gradients final" events, never on a rank-local test
    of completion. With host buffers and MPI_THREAD_MULTIPLE, ready buckets go
    in order to a communication thread running one blocking Allreduce each.
    Otherwise each ``grads_final`` event starts at most one ready bucket's Iallreduce,
    and ``wait`` reduces the buckets not yet started with blocking Allreduces,
    bucket by bucket: on MPICH's shared memory 25 MB pieces ran at 2.3-2.5x the
    bandwidth of one 100 MB Allreduce (bench/bench_allreduce_patterns.py).
    """

    def __init__(self, *, comm, transport, grads, bucket_mb: float, overlap: bool, diag=None):
        from mpi4py import MPI

        self.diag = diag  # parallel/watch.py: the waits below are recorded for the watchdog

        self.MPI = MPI
        self.comm, self.transport, self.backend, self.grads = comm, transport, transport.backend, grads
        self.overlap = overlap
        self.buckets = make_buckets(grads.data.shape[0], bucket_mb * 1e6 / 4)
        self.direct = transport.direct
        self.host = transport.host_buffer((grads.data.shape[0],))
        self.active = comm.Get_size() > 1
        self.wait_seconds = 0.0
        self._ready = 0  # buckets [0, _ready) have all their gradients written
        self._launched = 0  # buckets [0, _launched) have their reduction started
        self._requests = []
        # Host buffers with MPI_THREAD_MULTIPLE: a communication thread runs blocking Allreduces while
        # backward goes on (MPI progresses nonblocking collectives only inside MPI calls, so Iallreduce
        # alone barely overlaps). Device buffers keep the nonblocking path on the caller's thread.
        threaded = self.active and overlap and not self.backend.is_device and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._worker = _Reducer(comm) if threaded else None

    @property
    def threaded(self) -> bool:
        """True when a communication thread reduces the buckets."""
        return self._worker is not None

    def _buffer(self, lo, hi):
        """What MPI reduces for [lo, hi): the gradient slice itself, or its host staging copy."""
        return self.transport.outgoing(self.grads.data[lo:hi], None if self.direct else self.host[lo:hi])

    def start_step(self) -> None:
        self._ready = self._launched = 0
        self._requests = []

    def grads_final(self, lo: int) -> None:
        """Called by the last backward of a step once every gradient from offset ``lo`` on is final."""
        if not (self.active and self.overlap):
            return
        while self._ready < len(self.buckets) and self.buckets[self._ready][0] >= lo:
            self._ready += 1
        if self._worker is not None:
            while self._launched < self._ready:
                self._worker.submit(self.grads.data[slice(*self.buckets[self._launched])])
                self._launched += 1
            return
        if self._launched < self._ready:
            lo, hi = self.buckets[self._launched]
            self._requests.append(self.comm.Iallreduce(self.MPI.IN_PLACE, self._buffer(lo, hi), op=self.MPI.SUM))
            self._launched += 1
        if self._requests:
            self.MPI.Request.Testall(self._requests)  # drives MPI's progress on the buckets in flight

    def wait(self) -> None:
        """Complete the sum of every bucket (collective); afterwards every rank holds the same gradients."""
        if not self.active:
            return
        t0 = time.perf_counter()
        self.backend.synchronize()
        if self._worker is not None:
            for lo, hi in self.buckets[self._launched :]:
                self._worker.submit(self.grads.data[lo:hi])
            self._launched = len(self.buckets)
            self._worker.join()
            self.wait_seconds = time.perf_counter() - t0
            return
        for lo, hi in self.buckets[self._launched :]:  # not started yet: blocking, bucket by bucket
            self.comm.Allreduce(self.MPI.IN_PLACE, self._buffer(lo, hi), op=self.MPI.SUM)
        if self.diag is None:
            self.MPI.Request.Waitall(self._requests)
        elif self._requests:
            self.diag.begin(f"the wait for {len(self._requests)} gradient Iallreduce(s) over dp")
            try:
                self.MPI.Request.Waitall(self._requests)
            finally:
                self.diag.end()
        self._requests = []
        self._launched = len(self.buckets)
        self.transport.incoming(self.host, self.grads.data)
        self.wait_seconds = time.perf_counter() - t0

    def close(self) -> None:
        """Stop the communication thread, if any (not collective)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None


class _Reducer:
    """A daemon thread that sums submitted buffers over ``comm`` with blocking Allreduce, in order.

    Only this thread uses ``comm`` while a step's buckets are in flight; ``join`` waits for all
    of them and re-raises the thread's error, if any.
    """

    def __init__(self, comm):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, comm
        self.queue = queue.Queue()
        self.error = None
        threading.Thread(target=self._run, name="hpctrain-grad-allreduce", daemon=True).start()

    def submit(self, buf) -> None:
        self.queue.put(buf)

    def close(self) -> None:
        """Stop the thread once what was submitted is done."""
        self.queue.put(None)

    def _run(self):
        while True:
            buf = self.queue.get()
            if buf is None:
                self.queue.task_done()
                return
            try:
                if self.error is None:
                    self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
            except BaseException as e:  # handed to the training thread in join()
                self.error = e
            finally:
                self.queue.task_done()

    def join(self) -> None:
        self.queue.join()
        if self.error is not None:
            raise self.error
