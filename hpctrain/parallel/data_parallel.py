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
On a device with MPI_THREAD_MULTIPLE the communication thread does it: each
"gradients final" event records a device event (``backend.mark``), and the thread
waits for it, copies the ready buckets out on the copy stream, Allreduces them and
queues their copies back; ``wait()`` makes the training stream wait for those copies
on the device, so the training thread itself never waits for the GPU here.

With ``train.deterministic`` (parallel/deterministic.py) a ``ShardTree`` sums the step's
micro-batch gradients in a fixed pairwise tree (each backward writes its own; ``leaf_done``
and, for the last, the "gradients final" events fold them in), and each bucket is summed over
the group by recursive doubling (``tree_allreduce``) instead of an Allreduce, so the sum's
order, and its bits, do not depend on the layout.

With ``parallel.zero >= 1`` (parallel/zero.py) each bucket is reduce-scattered instead:
it is cut into dp chunks, and ``Reduce_scatter`` leaves the sum of chunk r on rank r
alone, written into the gradient buffer at the chunk's place; the rest of the bucket keeps
this rank's own, unreduced gradients (zero = 2 releases those pages at once). Where
``parallel.zero_reduce`` chose it, an ``Allreduce`` in place sums the bucket instead and each
rank keeps its chunk of it, the rest being released or left alone the same way. As the
optimizer finishes each bucket's chunk, ``gather_bucket`` all-gathers that bucket's
parameters (``Allgatherv`` in place, on the communication thread while the next chunk
updates); ``finish_gather`` waits for them. Buckets holding a tensor tied across
pipeline stages (the GPT's token embedding) wait until ``wait()``: the two ends first sum
their local gradients of it over ``ends_comm`` (``presum``), since after the scatter no
rank holds the whole reduced tensor. Without MPI_THREAD_MULTIPLE the buckets are
reduce-scattered in ``wait()``, after backward, and gathered one by one. On a device the
communication thread does both as it does the Allreduce: it waits for the event recorded with a
bucket, stages it (or hands device memory to a CUDA-aware MPI), reduce-scatters it in place
(this rank's sum lands at the bucket's start) and queues the sum's copy to the chunk's place;
a gather waits for the event recorded after its chunk's update, stages that chunk out, and
queues the gathered bucket's copy back. The training stream waits for those copies on the
device, so ZeRO adds no host wait to a step.

With ``parallel.reduce_dtype = "bf16"`` (parallel/wire.py) every bucket travels as bfloat16: rounded into
a packed host buffer, summed by a user-defined MPI operator, widened back. A device's buckets are then
staged through host memory even under a CUDA-aware MPI (the rounding runs on the host). ``sent_bytes``
counts the step's gradient payload handed to MPI (a bucket's values times the wire type's size).
"""

from __future__ import annotations

import time

import numpy as np

from .deterministic import tree_allreduce
from .transport import CommThread, Transport
from .wire import Wire
from .zero import overlap as _overlap

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
    of completion. With MPI_THREAD_MULTIPLE, ready buckets go in order to a communication
    thread running one blocking collective each (on a device, after waiting for the
    event recorded with them and staging them on the copy stream).
    Otherwise each ``grads_final`` event starts at most one ready bucket's Iallreduce,
    and ``wait`` reduces the buckets not yet started with blocking Allreduces,
    bucket by bucket: on MPICH's shared memory 25 MB pieces ran at 2.3-2.5x the
    bandwidth of one 100 MB Allreduce (bench/bench_allreduce_patterns.py).

    ZeRO (``shard``: a ZeroShard, parallel/zero.py, whose buckets these are): each bucket is
    reduce-scattered into its dp chunks, chunk r to rank r. ``release``: the gradient buffer's
    ReleasableHost (zero = 2, parallel/grad_pages.py) or on a GPU its ReleasableDevice (backend/cuda/vmm.py),
    whose memory outside this rank's chunk leaves once its bucket is scattered (``will_write`` gives a layer some
    back before it writes).
    ``tied``: (local ranges, presum) of tensors tied across pipeline stages; their buckets are
    scattered in ``wait()`` after ``presum()``. ``allreduce`` (ZeRO, ``parallel.zero_reduce``): each bucket is
    Allreduced in place instead and the rank keeps its chunk of the sum, twice the bytes for an MPI whose
    Allreduce runs faster than its Reduce_scatter (parallel/zero.py: ``reduce_choice``).
    """

    def __init__(self, *, comm, transport, grads, bucket_mb: float, overlap: bool, diag=None, shard=None,
                 release=None, tied=None, tree=None, allreduce=False, reduce_dtype="fp32"):
        from mpi4py import MPI

        self.diag = diag  # parallel/watch.py: the waits below are recorded for the watchdog

        self.MPI = MPI
        self.comm, self.transport, self.backend, self.grads = comm, transport, transport.backend, grads
        self.overlap = overlap
        size = grads.data.shape[0]
        # ZeRO: the shard's buckets (zero = 2 on the host cuts them on huge pages, parallel/zero.py)
        self.buckets = list(shard.buckets) if shard is not None else make_buckets(size, bucket_mb * 1e6 / 4)
        self.active = comm.Get_size() > 1
        bf16 = reduce_dtype == "bf16" and self.active
        if bf16 and tree is not None:
            raise ValueError("a deterministic (tree) sum adds in float32: parallel.reduce_dtype must be fp32")
        if bf16 and transport.direct and transport.backend.is_device:  # the rounding runs on the host
            self.transport = transport = Transport(transport.backend, cuda_aware=False)
        self.direct = transport.direct
        self.wire = Wire(size) if bf16 else None
        self.itemsize = Wire.itemsize if bf16 else 4
        self.sent_bytes = 0  # the gradient payload this rank handed to MPI this step
        self._pending = []  # bf16 Iallreduces: (packed, buf) to widen once they complete
        self.host = transport.host_buffer((size,)) if self.active else None  # staging for MPI (None: direct)
        self.shard = shard if self.active else None
        self.release = release if self.shard else None
        self.allreduce = bool(allreduce and self.shard)  # ZeRO: each bucket Allreduced, the rank keeping its chunk
        self.tree = tree  # train.deterministic: a ShardTree over this rank's micro-batches (parallel/deterministic.py)
        if tree is not None and self.shard is not None:
            raise ValueError("a deterministic (tree) sum cannot reduce-scatter (ZeRO)")
        self._last_leaf, self._folded = None, size  # the tree: the step's last micro-batch, folded from here on
        self.wait_seconds = 0.0
        self.released_bytes = 0  # zero = 2: gradient bytes released this step (to the kernel or the pool)
        self.backpressure_seconds = 0.0  # zero = 2: the backward's waits for earlier buckets' release, this step
        self._ready = 0  # buckets [0, _ready) have all their gradients written
        self._launched = 0  # buckets [0, _launched) have their reduction started (or are held)
        self._requests = []
        self._held, self._presum = [], None
        if self.shard:
            ranges, self._presum = tied if tied else ((), None)
            self._held = [i for i, b in enumerate(self.buckets) if any(_overlap(b, r)[1] > _overlap(b, r)[0]
                                                                      for r in ranges)]
            biggest = max((parts[self.shard.rank][1] - parts[self.shard.rank][0] for parts in self.shard.parts),
                          default=0)
            # Reduce_scatter may not write into the buffer it reads: each bucket's sum lands here first
            self._scatter_out = None if self.allreduce else (
                self.backend.empty((biggest,)) if self.direct else transport.host_buffer((biggest,)))
        # With MPI_THREAD_MULTIPLE a communication thread runs blocking collectives while backward goes on (MPI
        # progresses nonblocking collectives only inside MPI calls, so Iallreduce alone barely overlaps); on a
        # device it also waits for the gradients and stages them, for the Allreduce, ZeRO's reduce-scatters and
        # all-gathers, and the deterministic tree (whose sums it then adds on the host, the same float32 bits).
        self._device = self.backend.is_device
        threaded = self.active and overlap and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._worker = CommThread("hpctrain-grad-allreduce", on_start=self.backend.bind_thread) if threaded else None
        if tree is not None and self.active:
            biggest = max(hi - lo for lo, hi in self.buckets)
            on_host = not self.direct or (self._device and threaded)  # the tree's additions on the host
            self._tree_in = np.empty(biggest, dtype=np.float32) if on_host else self.backend.empty((biggest,))
            # a device's thread stages the tree's buckets even under a CUDA-aware MPI
            self._tree_host = self.host if self.host is not None or not on_host else transport.backend.pinned_host(
                (size,))
        self._arrived = []  # device: events of the buckets' copies back, for the training stream to wait on
        self._moves = []  # device, CUDA-aware ZeRO: (lo, a, b): a reduced chunk at [lo, lo + b - a) goes to [a, b)

    @property
    def threaded(self) -> bool:
        """True when a communication thread reduces the buckets."""
        return self._worker is not None

    def _buffer(self, lo, hi):
        """What MPI reduces for [lo, hi): the gradient slice itself, or its host staging copy."""
        return self.transport.outgoing(self.grads.data[lo:hi], None if self.direct else self.host[lo:hi])

    def _allreduce_when(self, i, ready) -> None:
        """Bucket i's Allreduce on a device's communication thread, once ``ready`` (an event recorded when its
        gradients were final) is done; the copy back is queued and its event kept for ``wait``."""
        lo, hi = self.buckets[i]
        dev, host = self.grads.data[lo:hi], None if self.direct else self.host[lo:hi]
        buf = self.transport.outgoing_when(dev, host, ready)
        self._allreduce(buf, lo)
        arrived = self.transport.incoming_async(host, dev)
        if arrived is not None:
            self._arrived.append(arrived)

    def _scatter_when(self, i, ready) -> None:
        """ZeRO on a device's communication thread: bucket i reduce-scattered in place once ``ready`` is done. MPI
        leaves this rank's summed chunk at the bucket's start; staged, its copy to the chunk's place is queued on
        the upload stream (its event kept for ``wait``), CUDA-aware, ``wait`` queues it on the training stream."""
        (lo, hi), parts = self.buckets[i], self.shard.parts[i]
        a, b = parts[self.shard.rank]
        host = None if self.direct else self.host[lo:hi]
        buf = self.transport.outgoing_when(self.grads.data[lo:hi], host, ready)
        if self.allreduce:  # the sum of chunk [a, b) is in its place: staged, only its copy back is queued
            self._allreduce(buf, lo)
            if b > a and host is not None:
                self._arrived.append(self.transport.incoming_async(host[a - lo : b - lo], self.grads.data[a:b]))
        else:
            self._reduce_scatter(buf, lo, [y - x for x, y in parts])
            if b > a and host is not None:
                self._arrived.append(self.transport.incoming_async(host[: b - a], self.grads.data[a:b]))
            elif host is None and b > a > lo:  # CUDA-aware, not the first chunk: [lo, lo + b - a) and [a, b) do
                # not overlap, since split_range gives chunk r the offset r * per and each chunk at most per values
                # (a device's chunks are split_range's under a CUDA-aware MPI: zero 2 releases only when staged)
                self._moves.append((lo, a, b))
        if self.release is not None:  # zero = 2, staged (train/startup.py): the bucket's copy out is done
            self._release_outside(lo, hi, a, b)

    def _tree_when(self, i, ready) -> None:
        """The deterministic tree on a device's communication thread: bucket i staged once ``ready`` is done (under a
        CUDA-aware MPI too), summed by recursive doubling with host additions, and its copy back queued."""
        lo, hi = self.buckets[i]
        host = self._tree_host[lo:hi]
        self.backend.stage_out(self.grads.data[lo:hi], host, ready)
        tree_allreduce(self.comm, host, self._tree_in[: hi - lo], lambda out, x: np.add(out, x, out=out))
        self._arrived.append(self.backend.stage_in(host, self.grads.data[lo:hi]))

    def _submit(self, i, ready) -> None:
        """Bucket i to the communication thread (``ready``: the device event its gradients wait for)."""
        if self._device:
            when = self._scatter_when if self.shard else self._tree_when if self.tree is not None else \
                self._allreduce_when
            self._worker.submit(lambda: when(i, ready))
        else:
            self._worker.submit(lambda: self._reduce(i))

    def _reduce(self, i) -> None:
        """Bucket i's blocking collective: an Allreduce in place, or the reduce-scatter into its chunks."""
        lo, hi = self.buckets[i]
        if self.tree is not None:
            buf = self._buffer(lo, hi)
            add = self.backend.add_ if self.direct else (lambda out, x: np.add(out, x, out=out))  # staged: on host
            tree_allreduce(self.comm, buf, self._tree_in[: hi - lo], add)
            return
        if not self.shard:
            self._allreduce(self._buffer(lo, hi), lo)
            return
        parts = self.shard.parts[i]
        a, b = parts[self.shard.rank]  # the whole chunk, a tied replica's values too (the optimizer skips those)
        if self.allreduce:
            buf = self._buffer(lo, hi)
            self._allreduce(buf, lo)
            out = None if self.direct else buf[a - lo : b - lo]  # direct: summed in place; staged: copied back
        else:
            out = self._scatter_out[: b - a]
            self._reduce_scatter(self._buffer(lo, hi), lo, [y - x for x, y in parts], out)
        if b > a and out is not None:
            self.backend.copy_(self.grads.data[a:b], out)  # a device array, or host memory (staged or the CPU)
        if self.release is not None:  # zero = 2: the rest of the bucket is this rank's unreduced gradients
            self._release_outside(lo, hi, a, b)

    def _allreduce(self, buf, lo: int) -> None:
        """A blocking Allreduce of ``buf`` (bucket at offset ``lo``) in place; bf16: through the packed wire."""
        self.sent_bytes += buf.shape[0] * self.itemsize
        if self.wire is None:
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
            return
        packed = self.wire.pack(buf, lo)
        self.comm.Allreduce(self.MPI.IN_PLACE, self.wire.message(packed), op=self.wire.op)
        self.wire.unpack(packed, buf)

    def _reduce_scatter(self, buf, lo: int, counts, out=None) -> None:
        """Reduce_scatter of bucket ``buf`` (at offset ``lo``) into chunks of ``counts``: this rank's sum into
        ``out``, or (None) in place at ``buf``'s start; bf16: through the packed wire, in place there."""
        self.sent_bytes += buf.shape[0] * self.itemsize
        if self.wire is None:
            if out is None:
                self.comm.Reduce_scatter(self.MPI.IN_PLACE, buf, counts, op=self.MPI.SUM)
            else:
                self.comm.Reduce_scatter(buf, out, counts, op=self.MPI.SUM)
            return
        packed = self.wire.pack(buf, lo)
        self.comm.Reduce_scatter(self.MPI.IN_PLACE, self.wire.message(packed), counts, op=self.wire.op)
        n = counts[self.comm.Get_rank()]
        self.wire.unpack(packed[:n], buf[:n] if out is None else out)

    def _iallreduce(self, lo: int, hi: int):
        """Bucket [lo, hi)'s Iallreduce in place (bf16: of its packed copy, widened in ``_wait_requests``)."""
        buf = self._buffer(lo, hi)
        self.sent_bytes += buf.shape[0] * self.itemsize
        if self.wire is None:
            return self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        packed = self.wire.pack(buf, lo)
        self._pending.append((packed, buf))
        return self.comm.Iallreduce(self.MPI.IN_PLACE, self.wire.message(packed), op=self.wire.op)

    def _release_outside(self, lo, hi, a, b) -> None:
        """zero = 2: bucket [lo, hi)'s values beyond this rank's chunk [a, b) leave memory (MPI is done with them)."""
        self.released_bytes += self.release.release(lo, a if b > a else hi) + (
            self.release.release(b, hi) if b > a else 0)

    def will_write(self, ranges) -> None:
        """zero = 2: a layer is about to write its gradients in ``ranges`` (local [lo, hi) offsets); their
        released units get pooled pages back (parallel/grad_pages.py). Where that brings released memory back,
        the buckets handed to the communication thread before the last one are first reduced (and so released):
        a backward pass that outruns the reductions would otherwise hold every bucket's gradients at once."""
        if self._worker is not None and any(self.release.needs(lo, hi) for lo, hi in ranges):
            t0 = time.perf_counter()
            self._worker.wait_done(self._worker.submitted - 1)
            self.backpressure_seconds += time.perf_counter() - t0
        for lo, hi in ranges:
            self.release.fill(lo, hi)

    def start_step(self) -> None:
        self._ready = self._launched = 0
        self._requests = []
        self.released_bytes = 0
        self.sent_bytes = 0
        self.backpressure_seconds = 0.0
        if self.tree is not None:
            self.tree.start()
            self._last_leaf, self._folded = None, self.grads.data.shape[0]

    def leaf_done(self, leaf: int) -> None:
        """The tree: micro-batch ``leaf``'s backward (not the step's last) wrote its whole gradient."""
        self.tree.push(leaf, 0, self.grads.data.shape[0])

    def last_leaf(self, leaf: int) -> None:
        """The tree: the step's last backward, about to run, is micro-batch ``leaf``'s; its gradient is folded in
        range by range as the "gradients final" events (and ``wait``) come."""
        self._last_leaf = leaf

    def _fold(self, lo: int) -> None:
        if self.tree is not None and self._last_leaf is not None and lo < self._folded:
            self.tree.push(self._last_leaf, lo, self._folded, last_slice=False)
            self._folded = lo

    def grads_final(self, lo: int) -> None:
        """Called by the last backward of a step once every gradient from offset ``lo`` on is final."""
        self._fold(lo)
        if not (self.active and self.overlap):
            return
        while self._ready < len(self.buckets) and self.buckets[self._ready][0] >= lo:
            self._ready += 1
        if self._worker is not None:
            ready = self.backend.mark() if self._launched < self._ready else None  # the kernels queued so far
            while self._launched < self._ready:
                if self._launched not in self._held:
                    self._submit(self._launched, ready)
                self._launched += 1
            return
        if self.shard or self.tree is not None:
            return  # no overlap for reduce-scatters or tree sums on this path: wait() runs them
        if self._launched < self._ready:
            self._requests.append(self._iallreduce(*self.buckets[self._launched]))
            self._launched += 1
        if self._requests:
            self.MPI.Request.Testall(self._requests)  # drives MPI's progress on the buckets in flight

    def wait(self) -> None:
        """Complete the sum of every bucket (collective); afterwards every rank holds the same gradients
        (under ZeRO: the summed gradients of its own chunks)."""
        self._fold(0)
        if not self.active:
            return
        t0 = time.perf_counter()
        if self._worker is not None:
            ready = self.backend.mark()
            for i in range(self._launched, len(self.buckets)):
                if i not in self._held:
                    self._submit(i, ready)
            self._launched = len(self.buckets)
            self._worker.join()
            self._arrivals()
            for lo, a, b in self._moves:  # ZeRO, CUDA-aware: each summed chunk to its place, on the stream
                self.backend.copy_(self.grads.data[a:b], self.grads.data[lo : lo + b - a])
            self._moves = []
        else:
            self.backend.synchronize()
            for i in range(self._launched, len(self.buckets)):  # not started yet: blocking, bucket by bucket
                if i not in self._held:
                    self._reduce(i)
            self._wait_requests()
            self._launched = len(self.buckets)
            if not self.shard:
                self.transport.incoming(self.host, self.grads.data)
        if self._held:
            self._presum()  # the tied tensors' two ends, before their buckets leave the full buffer
            for i in self._held:
                self._reduce(i)
        self.wait_seconds = time.perf_counter() - t0

    def _wait_requests(self) -> None:
        if self.diag is None:
            self.MPI.Request.Waitall(self._requests)
        elif self._requests:
            self.diag.begin(f"the wait for {len(self._requests)} gradient Iallreduce(s) over dp")
            try:
                self.MPI.Request.Waitall(self._requests)
            finally:
                self.diag.end()
        self._requests = []
        for packed, buf in self._pending:
            self.wire.unpack(packed, buf)
        self._pending = []

    def _arrivals(self) -> None:
        """The training stream waits, on the device, for the copies the communication thread queued; the host
        does not."""
        for arrived in self._arrived:
            if arrived is not None:
                self.backend.after(arrived)
        self._arrived = []

    def gather_bucket(self, i: int, params) -> None:
        """ZeRO: every rank's updated chunk of bucket i of ``params`` (a backend array, this part's layout) to
        every rank with ``Allgatherv`` in place; on the communication thread when there is one, so the
        optimizer updates the next bucket meanwhile (collective over ``comm``; ``finish_gather`` completes).
        On a device the thread waits for an event recorded now, after the update's kernels."""
        if not self.shard:
            return
        if self._worker is not None:
            ready = self.backend.mark() if self._device else None
            self._worker.submit(lambda: self._gather(i, params, ready))
        else:
            self._gather(i, params)

    def _gather(self, i: int, params, ready=None) -> None:
        (lo, hi), parts = self.buckets[i], self.shard.parts[i]
        host = None if self.direct else self.host[lo:hi]
        if ready is None:  # host memory, or a device from the training thread (which waits)
            buf = self.transport.outgoing(params[lo:hi], host)
        else:  # a device's communication thread: only this rank's chunk goes out (the rest MPI overwrites)
            a, b = parts[self.shard.rank]
            self.transport.outgoing_when(params[a:b], None if host is None else host[a - lo : b - lo], ready)
            buf = params[lo:hi] if host is None else host
        self.comm.Allgatherv(self.MPI.IN_PLACE, [buf, [b - a for a, b in parts], [a - lo for a, _ in parts],
                                                 self.MPI.FLOAT])
        if ready is None:
            self.transport.incoming(buf, params[lo:hi])
        else:
            self._arrived.append(self.transport.incoming_async(host, params[lo:hi]))

    def finish_gather(self) -> None:
        """Complete the all-gathers ``gather_bucket`` started; afterwards every rank holds the same parameters (on
        a device: what the stream runs next sees them)."""
        if self.shard and self._worker is not None:
            self._worker.join()
            self._arrivals()

    def close(self) -> None:
        """Stop the communication thread, if any (not collective)."""
        self._worker = CommThread.stop(self._worker)
        if self.wire is not None:
            self.wire.close()
