"""Run one pipeline stage's instruction list: the same executor for data, pipeline and evaluation steps.

    executor = StageExecutor(backend=be, part=part, loss=loss, stage=s, stages=P, p2p=p2p, sync=sync,
                             stats=check_schedule(schedule), max_rows=rows)
    result = executor.run(schedule.stages[s], batch, on_optimizer_step=finish)

Instructions are dispatched through one table (instruction type -> method). What the
forward pass of micro-batch i saves for its backward pass lives in ``_saved[i]`` until
that backward runs, so a stage holds exactly the micro-batches its schedule keeps
live (1F1B: at most P - s, GPipe: m); the executor reports the peak count and bytes.

Receives are posted early, as soon as a slot of a preallocated ring is free, so a
sender never waits on a receive the schedule has not reached yet; the rings are
sized from the checker's peak of live received activations (an input activation
is kept for its micro-batch's backward, which reads it). Sends are ``Isend``s kept
referenced until they complete (parallel/transport.py).

On a GPU (``backend.timer()`` gives events) the forward and backward instructions are
timed by events on the stream, not by host clocks around launches that return at once:
``busy`` is their GPU time and ``device_span`` the GPU time from the first to the last,
read once the step's wait has passed them (else the host times stand).

On the last stage each micro-batch's loss sums go into a row of a small backend array
(``loss(..., into=row)``), not to the host: a device is not waited for at each
micro-batch. The optimizer step reads the rows together with the gradient norm, in the
step's one wait (``pending_loss_rows``/``settle_losses``); a list without an
optimizer step (evaluation) reads them at its end. Token ids and class targets
(int64) stay in host memory: the backend checks and uploads them itself, and the
embedding's backward sorts them there without reading them back.

Collective behaviour: every stage of a pipeline group must run its own list of the
same schedule for the same step; the stages' messages then match one for one (the
checker proved it before the first step). ``ReduceGrads`` is collective over the
data-parallel group of this stage; ``on_optimizer_step`` over whatever it reduces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import BackendError

from .zero3 import unit_uses
from .schedule import (Backward, BackwardInput, BackwardWeight, Exchange, Forward, LoadMicroBatch, OptimizerStep,
                       RecvActivation, RecvGrad, ReduceGrads, SendActivation, SendGrad)

__all__ = ["StageExecutor", "StepResult", "bubble_share", "nbytes_of", "micro_rows"]

ACTIVATION, GRAD = 0, 1  # message kinds; the tag of micro-batch i's message is 2·(i·v + c) + kind, c: the chunk
# of the lower of the two virtual stages it joins (2·i + kind with one chunk per stage)


@dataclass
class StepResult:
    """What one run of a stage's list measured (seconds) and, on the last stage, the loss sums."""

    busy: float = 0.0  # forward and backward kernels (and the loss); on a GPU their GPU time (events)
    device_span: float = 0.0  # on a GPU: GPU time from the first forward or backward to the last (0: host times)
    wait: float = 0.0  # blocked on other stages: point-to-point messages, and the wait that on_optimizer_step reports
    data: float = 0.0  # reading micro-batches
    comm: float = 0.0  # the data-parallel gradient reduction (ReduceGrads; zero = 2: a backward's waits for it too)
    optim: float = 0.0  # OptimizerStep, less its wait
    span: float = 0.0  # the whole list
    loss_sum: float = 0.0
    losses: dict = field(default_factory=dict)  # micro-batch -> its loss sum (train.deterministic sums these in order)
    correct: float = 0.0
    rows: int = 0
    peak_live: int = 0  # micro-batches forwarded but not yet backwarded
    peak_bytes: int = 0  # bytes their saved activations held
    extra: dict = field(default_factory=dict)  # what on_optimizer_step returns (less its "wait" seconds)
    kernels: dict = field(default_factory=dict)  # compute instruction -> its host seconds (Forward(3): 0.0051); on a
    # GPU the host's time to queue it, not the kernels' (those are in ``busy``)

    @property
    def bubble(self) -> float:
        if self.device_span > 0:  # GPU time: the share of the compute span the GPU spent outside this stage's work
            return max(0.0, 1.0 - self.busy / self.device_span)
        return bubble_share(busy=self.busy, data=self.data, span=self.span, comm=self.comm, optim=self.optim)


def bubble_share(*, busy, data, span, comm, optim) -> float:
    """Share of a step, less its gradient reduction and optimizer work, not spent in the stage's own work.

    What (P − 1)/(m + P − 1) predicts for P equal stages and m micro-batches: waits for other stages,
    in messages or in the gradient norm's reduction, count; the data-parallel Allreduce does not.
    """
    pipeline = span - comm - optim
    return max(0.0, 1.0 - (busy + data) / pipeline) if pipeline > 0 else 0.0


def micro_rows(local: int, micro_batches: int) -> int:
    """Samples in one micro-batch of a rank's batch share of ``local``: what a receive-ring slot holds (times the
    rows per sample), and so the chunk evaluation runs in."""
    return max(1, local // max(1, micro_batches))


class _Ring:
    """Preallocated receive buffers of (max_rows, width) with their host staging twins.

    ``ready[slot]``: a device event MPI must see done before it writes the slot again (None: nothing to wait
    for): staged, the copy out of the host twin; direct (a CUDA-aware MPI writes the device array), the last
    kernel that read it. A device's step waits for one only where the step's one wait has not passed it.
    """

    def __init__(self, backend, transport, size: int, max_rows: int, width: int):
        self.arrays = [backend.empty((max_rows, width)) for _ in range(size)]
        self.hosts = [transport.host_buffer((max_rows, width)) for _ in range(size)]
        self.free = list(range(size))
        self.ready = [None] * size
        self.width = width

    def view(self, slot: int, rows: int, width: int):
        """Slot ``slot`` as a contiguous (rows, width) array and its host twin (None when direct): the first rows
        of the slot, or, for a narrower message (a model chunk's), the start of its memory."""
        arr, host = self.arrays[slot], self.hosts[slot]
        if width == self.width:
            return arr[:rows], None if host is None else host[:rows]
        n = rows * width
        return (arr.reshape(arr.size)[:n].reshape(rows, width),
                None if host is None else host.reshape(host.size)[:n].reshape(rows, width))


class StageExecutor:
    """Executes stage ``stage`` of ``stages``: its instructions, its part, its messages and its gradient sync."""

    def __init__(self, *, backend, part, loss, stage: int, stages: int, p2p, sync, stats, max_rows: int, tracer=None,
                 virtual_stages: int = 1):
        self.be, self.part, self.loss, self.p2p, self.sync, self.tracer = backend, part, loss, p2p, sync, tracer
        self.stage, self.stages, self.virtual_stages = stage, stages, virtual_stages
        self.max_rows = max_rows
        self.stats = stats
        # zero = 2 on the host: each layer's gradients get released memory back just before it writes them
        self._on_write = sync.will_write if sync is not None and getattr(sync, "release", None) is not None else None
        self.table = {
            LoadMicroBatch: self._load, Forward: self._timed_by(self._forward),
            Backward: self._timed_by(self._backward), BackwardInput: self._timed_by(self._backward_input),
            BackwardWeight: self._timed_by(self._backward_weight),
            SendActivation: self._send, SendGrad: self._send, RecvActivation: self._recv, RecvGrad: self._recv,
            Exchange: self._exchange, ReduceGrads: self._reduce, OptimizerStep: self._optimizer_step,
        }
        self._rings = {}  # kind -> _Ring, made on first use
        self._freed = False  # a ring slot was freed since the receives were last posted ahead
        self._plans = {}  # id(instruction list) -> (the list, its receives, its last Backward)
        self._saved_bytes = {}  # rows -> bytes a forward pass keeps for backward (the same for every step)

    def rings(self) -> list:
        """The receive rings made so far (each with ``arrays`` and their host staging twins ``hosts``)."""
        return list(self._rings.values())

    # ------------------------------------------------------------------ running a list

    def run(self, instructions, batch, *, grad_scale: float = 0.0, on_optimizer_step=None) -> StepResult:
        """Run ``instructions`` on ``batch`` (``rows(i)``, ``load(i) -> (x, y)`` host arrays of micro-batch i,
        ``len``: the micro-batches)."""
        self.batch, self.grad_scale, self.on_optimizer_step = batch, grad_scale, on_optimizer_step
        self.result = StepResult()
        # keyed by (mb, chunk): a micro-batch's input, targets, saved activations and their bytes
        self._x, self._y, self._saved, self._live_bytes = {}, {}, {}, {}
        self._out, self._dout, self._dinp = {}, {}, {}  # activation to send, gradient in, gradient to send
        self._slots = {}  # (kind, mb, chunk) -> (ring slot, pending receive or None once waited)
        receives, self._last_backward = self._plan(instructions)
        if getattr(self.part, "gather", None) is not None:  # zero 3: the units' gathers follow the schedule
            self.part.gather.expect(self._plans[id(instructions)][3])
        self._pending = {kind: list(keys) for kind, keys in receives.items()}  # pop() takes the next
        self._wrote = set()  # chunks whose gradients a backward has written this step (later ones add)
        self._wrote_input = self._wrote_weight = False  # zero-bubble: the first B and the first W write, not add
        self._wsaved = {}  # mb -> what its BackwardWeight needs
        self._loss_rows = None  # the last stage: [loss sum, correct, first bad row] per micro-batch, on the backend
        self._losses = []  # (mb, (loss sum, correct) read already, or None: in _loss_rows), in forward order
        self._timed = []  # on a GPU: (start, end) timing events of each forward and backward instruction
        self._timed_mark = None  # a mark after the last of them
        t0 = time.perf_counter()
        for ring in self._rings.values():  # every step hands its receives the same slots in the same order (a
            ring.free.sort(reverse=True)  # replayed step's graphs hold their addresses: backend/cuda/graphs.py)
        self._freed = True  # a receive slot may be free: _post_ahead has something to look at
        self._post_ahead()
        for self._index, ins in enumerate(instructions):
            self.table[type(ins)](ins)
            if self.p2p is not None:
                if self._freed:
                    self._post_ahead()
                self.p2p.progress()
        if self.p2p is not None:
            w0 = time.perf_counter()
            self.p2p.wait_sends()
            self.result.wait += time.perf_counter() - w0
        if self._losses:  # no optimizer step read them (evaluation): one wait here
            rows = self.pending_loss_rows()
            self.settle_losses(None if rows is None else self.be.read_host(rows)[0])
        self._loss_rows = None  # read: nothing of the step's device memory outlives it (backend/arena.py)
        self._device_times()
        self.result.span = time.perf_counter() - t0
        return self.result

    def _timed_by(self, method):
        """``method`` (a forward or backward instruction) between two timing events on a GPU; its host time kept in
        ``result.kernels`` (``schedule.makespan`` replays the step with them: what the kernels alone allow)."""

        def run(ins) -> None:
            start = self.be.timer()
            t0 = time.perf_counter()
            method(ins)
            self.result.kernels[ins] = time.perf_counter() - t0
            if start is not None:
                self._timed.append((start, self.be.timer()))
                self._timed_mark = self.be.mark()

        return run

    def _device_times(self) -> None:
        """On a GPU, once a wait has passed the run's last timing event: busy and device_span in GPU time."""
        if not self._timed or not self.be.passed(self._timed_mark):
            return
        be = self.be
        self.result.busy = sum(be.elapsed(a, b) for a, b in self._timed)
        self.result.device_span = be.elapsed(self._timed[0][0], self._timed[-1][1])

    # ------------------------------------------------------------------ loss sums, read once

    def pending_loss_rows(self):
        """The backend array of loss rows still to be read (None when there is none)."""
        return self._loss_rows if any(sums is None for _, sums in self._losses) else None

    def settle_losses(self, host_rows) -> None:
        """Add the run's loss sums to the result in forward order, the pending ones from ``host_rows`` (a host
        copy of ``pending_loss_rows()``); a class target outside the logits (device targets only: host ones are
        checked before the kernel) raises BackendError."""
        self.take_losses()[1](host_rows)

    def take_losses(self):
        """The run's loss sums handed over to be settled later (train/step.py reads them a step late):
        ``(rows, settle)``, the backend array of ``pending_loss_rows()`` and ``settle(host_rows)``, which adds
        them to this run's result as ``settle_losses`` does, whatever the executor has run since."""
        rows, losses, batch, result = self.pending_loss_rows(), self._losses, self.batch, self.result
        self._losses = []

        def settle(host_rows) -> None:
            for mb, sums in losses:
                if sums is None:
                    total, correct, bad = host_rows[mb]
                    n = batch.rows(mb)
                    if self.loss.classification and bad < n:
                        raise BackendError(f"cross_entropy: micro-batch {mb} has a target outside the logits' "
                                           f"columns in row {int(bad)} of {n}")
                    sums = float(total), float(correct)
                result.loss_sum += sums[0]
                result.losses[mb] = sums[0]
                result.correct += sums[1]

        return rows, settle

    def _plan(self, instructions):
        """Per list, once: the receives in program order (reversed, per kind: (mb, chunk)) and the index of each
        chunk's last Backward (its gradients are final after it: the sync's cue); and (``_plans`` only) the
        partition units the list uses, in order (zero 3's gathers: parallel/zero3.py, ``unit_uses``)."""
        plan = self._plans.get(id(instructions))
        if plan is None or plan[0] is not instructions:
            receives = {ACTIVATION: [], GRAD: []}
            last = {}
            for i, ins in enumerate(instructions):
                for op in (ins.send, ins.recv) if isinstance(ins, Exchange) else (ins,):
                    if isinstance(op, (RecvActivation, RecvGrad)):
                        receives[self._kind(op)].append((op.mb, op.chunk))
                if isinstance(ins, (Backward, BackwardWeight)):
                    last[ins.chunk] = i
            plan = self._plans[id(instructions)] = (instructions, {k: v[::-1] for k, v in receives.items()},
                                                    frozenset(last.values()), unit_uses(self.part, instructions))
        return plan[1], plan[2]

    def _tag(self, kind, mb: int, chunk: int, *, send: bool) -> int:
        """The tag of micro-batch mb's message of ``kind`` that this stage's chunk ``chunk`` sends or receives: both
        ends name the chunk of the lower of the two virtual stages it joins (an activation's sender, a gradient's
        receiver)."""
        here = chunk * self.stages + self.stage
        low = here if (kind == ACTIVATION) == send else here - 1
        return 2 * (mb * self.virtual_stages + low // self.stages) + kind

    def _trace(self, name, mb, t0, t1, chunk=0):
        if self.tracer is not None:
            self.tracer.span(name, mb, t0, t1, chunk)

    @staticmethod
    def _kind(op) -> int:
        return ACTIVATION if isinstance(op, (SendActivation, RecvActivation)) else GRAD

    # ------------------------------------------------------------------ receives, posted early into rings

    def _ring(self, kind) -> _Ring:
        if kind not in self._rings:
            width = max(w[0 if kind == ACTIVATION else 1] for w in self.part.chunk_widths)  # fits every chunk's
            # a received activation lives until its backward; one more slot lets the next receive go up early
            grads = self.stats.peak_recv_grad[self.stage] if self.stats.peak_recv_grad else 1  # W reads its B's
            size = (self.stats.peak_recv_activation[self.stage] if kind == ACTIVATION else grads) + 1
            self._rings[kind] = _Ring(self.be, self.p2p.transport, size, self.max_rows, width)
        return self._rings[kind]

    def _post_ahead(self) -> None:
        """Post the next receives of each kind into the ring slots free now (called again once ``_release`` has
        freed one: nothing else frees a slot)."""
        self._freed = False
        for kind, queue in self._pending.items():
            if not queue:
                continue
            ring = self._ring(kind)
            while queue and ring.free:
                mb, chunk = queue.pop()
                slot = ring.free.pop()
                if ring.ready[slot] is not None:  # a kernel or copy queued earlier may still read the buffer
                    self.be.host_wait_for(ring.ready[slot])
                    ring.ready[slot] = None
                width = self.part.chunk_widths[chunk][0 if kind == ACTIVATION else 1]
                arr, host = ring.view(slot, self.batch.rows(mb), width)
                # the neighbouring virtual stage: stage s ± 1, wrapping round between chunks
                source = (self.stage - 1 if kind == ACTIVATION else self.stage + 1) % self.stages
                handle = self.p2p.post_recv(arr, source=source, tag=self._tag(kind, mb, chunk, send=False),
                                            host=host)
                self._slots[(kind, mb, chunk)] = (slot, handle)

    def _release(self, kind, mb, chunk=0) -> None:
        slot, _ = self._slots.pop((kind, mb, chunk), (None, None))
        if slot is not None:
            ring = self._rings[kind]
            if self.be.is_device and self.p2p.transport.direct:  # MPI will write the device array itself
                ring.ready[slot] = self.be.mark()
            ring.free.append(slot)
            self._freed = True

    def _recv(self, ins) -> None:
        kind, key = self._kind(ins), (ins.mb, ins.chunk)
        if (kind, *key) not in self._slots:
            raise RuntimeError(f"stage {self.stage}: {ins} has no free receive buffer (ring sized too small)")
        slot, handle = self._slots[(kind, *key)]
        t0 = time.perf_counter()
        arr = handle.wait()
        t1 = time.perf_counter()
        if handle.uploaded is not None:  # staged: the host twin is free once the queued copy has run
            self._ring(kind).ready[slot] = handle.uploaded
        self._slots[(kind, *key)] = (slot, None)
        (self._x if kind == ACTIVATION else self._dout)[key] = arr
        self.result.wait += t1 - t0
        self._trace("recv " + ("activation" if kind == ACTIVATION else "grad"), ins.mb, t0, t1, ins.chunk)

    def _send(self, ins) -> None:
        kind = self._kind(ins)
        arr = (self._out if kind == ACTIVATION else self._dinp).pop((ins.mb, ins.chunk))
        dest = (self.stage + 1 if kind == ACTIVATION else self.stage - 1) % self.stages  # the next virtual stage
        t0 = time.perf_counter()
        self.p2p.post_send(arr, dest=dest, tag=self._tag(kind, ins.mb, ins.chunk, send=True))
        t1 = time.perf_counter()
        self.result.wait += t1 - t0
        self._trace("send " + ("activation" if kind == ACTIVATION else "grad"), ins.mb, t0, t1, ins.chunk)

    def _exchange(self, ins) -> None:
        self._send(ins.send)  # posted together with the receive, which is already up
        self._recv(ins.recv)

    # ------------------------------------------------------------------ compute

    def _load(self, ins) -> None:
        t0 = time.perf_counter()
        key = (ins.mb, ins.chunk)
        x, y = self.batch.load(ins.mb)
        if self.part.chunk_is_first(ins.chunk):
            self._x[key] = _upload(self.be, x)
        if self.part.chunk_is_last(ins.chunk):
            self._y[key] = _upload(self.be, y)
        t1 = time.perf_counter()
        self.result.data += t1 - t0
        self._trace("load", ins.mb, t0, t1, ins.chunk)

    def _forward(self, ins) -> None:
        mb, key = ins.mb, (ins.mb, ins.chunk)
        t0 = time.perf_counter()
        out, saved = self.part.forward(self.be, self._x[key], self.batch.key(mb), chunk=ins.chunk)
        if self.part.chunk_is_last(ins.chunk):
            if self._loss_rows is None:
                self._loss_rows = self.be.zeros((len(self.batch), 3), np.float64)
            loss_sum, correct, dout = self.loss(self.be, out, self._y.pop(key), self.grad_scale,
                                                into=self._loss_rows[mb])
            self._losses.append((mb, None if loss_sum is None else (float(loss_sum), float(correct))))
            self.result.rows += self.batch.rows(mb)
            self._dout[key] = dout
        else:
            self._out[key] = out
        if self.on_optimizer_step is None:  # evaluation: nothing is kept for a backward pass
            self._x.pop(key)
            self._dout.pop(key, None)
            self._release(ACTIVATION, *key)
        else:
            self._saved[key] = saved
            rows = (self.batch.rows(mb), ins.chunk)
            if rows not in self._saved_bytes:
                self._saved_bytes[rows] = nbytes_of(saved)
            self._live_bytes[key] = self._saved_bytes[rows]
            self.result.peak_live = max(self.result.peak_live, len(self._live_bytes))  # until its W, when split
            self.result.peak_bytes = max(self.result.peak_bytes, sum(self._live_bytes.values()))
        t1 = time.perf_counter()
        self.result.busy += t1 - t0
        self._trace("forward", mb, t0, t1, ins.chunk)

    def _backward(self, ins) -> None:
        mb, key = ins.mb, (ins.mb, ins.chunk)
        t0, held = time.perf_counter(), self._held()
        last = self._index in self._last_backward  # this chunk's last: its gradients are final after it
        tree = self.sync is not None and self.sync.tree is not None  # train.deterministic: one gradient per shard
        if tree and last:
            self.sync.last_leaf(mb)
        dinp = self.part.backward(self.be, self._dout.pop(key), self._saved.pop(key),
                                  accumulate=ins.chunk in self._wrote and not tree,
                                  need_dinp=not self.part.chunk_is_first(ins.chunk),
                                  on_final=self.sync.grads_final if last and self.sync is not None else None,
                                  on_write=self._on_write, chunk=ins.chunk)
        if tree and not last:
            self.sync.leaf_done(mb)
        self._wrote.add(ins.chunk)
        del self._live_bytes[key]
        self._x.pop(key)
        self._release(ACTIVATION, *key)
        self._release(GRAD, *key)
        if dinp is not None:
            self._dinp[key] = dinp  # SendGrad(mb) sends it
        t1 = time.perf_counter()
        self._count_busy(t1 - t0, held)
        self._trace("backward", mb, t0, t1, ins.chunk)

    def _backward_input(self, ins) -> None:
        """B: the input gradient, sent on by the next instruction; what W needs stays (with the received input
        and gradient buffers, which W reads). One chunk per stage (the zero-bubble schedule)."""
        mb, key = ins.mb, (ins.mb, 0)
        t0, held = time.perf_counter(), self._held()
        dinp, self._wsaved[mb] = self.part.backward_input(self.be, self._dout.pop(key), self._saved.pop(key),
                                                          accumulate=self._wrote_input,
                                                          need_dinp=not self.part.is_first, on_write=self._on_write)
        self._wrote_input = True
        if dinp is not None:
            self._dinp[key] = dinp
        t1 = time.perf_counter()
        self._count_busy(t1 - t0, held)
        self._trace("backward input", mb, t0, t1)

    def _backward_weight(self, ins) -> None:
        mb, key = ins.mb, (ins.mb, 0)
        t0, held = time.perf_counter(), self._held()
        last = self._index in self._last_backward
        self.part.backward_weight(self.be, self._wsaved.pop(mb), accumulate=self._wrote_weight,
                                  on_final=self.sync.grads_final if last and self.sync is not None else None,
                                  on_write=self._on_write)
        self._wrote_weight = True
        del self._live_bytes[key]
        self._x.pop(key)
        self._release(ACTIVATION, *key)
        self._release(GRAD, *key)
        t1 = time.perf_counter()
        self._count_busy(t1 - t0, held)
        self._trace("backward weight", mb, t0, t1)

    def _held(self) -> float:
        """Seconds the step's backward passes have waited so far for earlier buckets' reductions (zero = 2)."""
        return getattr(self.sync, "backpressure_seconds", 0.0)

    def _count_busy(self, seconds: float, held: float) -> None:
        """A backward's time: what it waited for the gradient reductions since ``held`` counts as communication."""
        waited = self._held() - held
        self.result.busy += seconds - waited
        self.result.comm += waited

    def _reduce(self, ins) -> None:
        t0 = time.perf_counter()
        if self.sync is not None:
            self.sync.wait()
        t1 = time.perf_counter()
        self.result.comm += t1 - t0
        self._trace("allreduce", -1, t0, t1)

    def _optimizer_step(self, ins) -> None:
        t0 = time.perf_counter()
        self.result.extra = dict(self.on_optimizer_step() or {})
        t1 = time.perf_counter()
        waited = self.result.extra.pop("wait", 0.0)  # for the other stages, e.g. in the gradient norm's reduction
        self.result.wait += waited
        self.result.optim += t1 - t0 - waited
        self._trace("optimizer", -1, t0, t1)


def _upload(be, arr):
    """A micro-batch's inputs or targets for the backend: int64 ids and class targets stay on the host (the
    backend checks them there and uploads them itself), anything else goes to the backend."""
    return arr if arr.dtype == np.int64 else be.upload(arr)


def nbytes_of(saved, align: int = 1) -> int:
    """Bytes of the distinct arrays in a (nested) saved structure, each rounded up to ``align`` bytes (the CUDA
    step arena's 512: hpctrain/arena_plan.py)."""
    seen, total, todo = set(), 0, [saved]
    while todo:
        item = todo.pop()
        if isinstance(item, (list, tuple)):
            todo.extend(item)
        elif hasattr(item, "inputs"):  # recompute's UnitInputs: each unit's input
            todo.extend(item.inputs)
        elif hasattr(item, "nbytes") and id(item) not in seen:
            seen.add(id(item))
            total += -(-int(item.nbytes) // align) * align
    return total
