"""One training step and one evaluation pass of this rank's stage, run as a checked schedule.

The step is a schedule (parallel/schedule.py): every stage's instruction list, checked
at start-up for deadlocks and unmatched messages, run by the stage executor
(parallel/executor.py). Pure data parallelism is the one-stage schedule. Finishing
the step (``OptimizerStep``) reduces over the right groups:

* a tensor two stages share (the GPT's tied embedding) has its gradient summed over
  the first and last stage (``ends_comm``);
* under ZeRO (parallel/zero.py) each data-parallel rank holds the reduced gradients of its own
  chunks only: the norm² is first summed over the data-parallel group, clipping and the
  optimizer touch the chunks, and the updated parameters are all-gathered afterwards;
* the gradient norm² is summed over the tensor-parallel ranks, then the pipeline stages:
  each tensor counted once (a shard on every tp rank, a replicated tensor on tp rank
  0, a tied tensor on its owner; data-parallel replicas hold the same reduced
  gradients), so every rank sees the same norm;
* the non-finite decision follows from that same norm on every rank;
* then clipping and the optimizer run on each stage's own part; a tied tensor's owner sends its
  updated values to the replica, which keeps no optimizer state of its own.

On a device backend whose norm needs no MPI (one stage, no tensor parallelism, no ZeRO, not
deterministic) the norm, clipping and the skip decision stay on the device and the step's loss and
norm are read at the next step's optimizer (``_finish_on_device``, ``settle``): the host queues a
step while the device runs the one before, and training gives the same bits.

Collective: ``train_step`` over the whole mesh (point-to-point within the pipeline
group, Allreduce within the data-parallel group, the tensor-parallel Allreduces of the
forward and backward passes within the tp group, the norm over the tp and pipeline
groups);
``evaluate`` and ``global_mean`` over the world communicator.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np

from ..errors import NonFiniteError
from ..nn.dropout import DropoutKey
from ..optim import clip_coefficient
from ..parallel.agree import QuietExit
from ..parallel.deterministic import norm_of, ordered_sum, tensor_norm2
from ..parallel.executor import StageExecutor, micro_rows
from ..parallel.agree import bcast_text
from ..parallel.schedule import ScheduleError, ScheduleStats, built, checked
from ..parallel.tied import refresh_replicas, sum_tied_grads
from ..parallel.zero3 import tied_ranges
from ..parallel.zero import overlap

__all__ = ["StepRunner"]


class _Batch:
    """Micro-batches as sample lists of the data file; ``load(i)`` reads micro-batch i (inputs, targets).

    ``rows(i)`` counts activation rows: samples × positions (a language model's every token). ``at_once``: the
    first ``load`` reads every micro-batch in one call and the others are slices of it (a training step's share
    of the batch; one read of the file costs about as much as one micro-batch's). ``dropout``: a training
    step's (seed, global step, place of its first sample in the step's global batch), from which ``key(i)``
    gives micro-batch i's DropoutKey (nn/dropout.py); None (evaluation): no key, no dropout.
    """

    def __init__(self, data, row_lists, positions=1, at_once=False, dropout=None):
        self.data, self.row_lists, self.positions, self.dropout = data, row_lists, positions, dropout
        self._all = None if at_once and len(row_lists) > 1 else False

    def key(self, mb: int):
        if self.dropout is None:
            return None
        seed, step, first = self.dropout
        return DropoutKey(seed, step, first + sum(len(r) for r in self.row_lists[:mb]))

    def __len__(self) -> int:
        return len(self.row_lists)

    def rows(self, mb: int) -> int:
        return len(self.row_lists[mb]) * self.positions

    def load(self, mb: int):
        if self._all is False:
            return self.data.read(self.row_lists[mb])
        if self._all is None:
            self._all = self.data.read(np.concatenate(self.row_lists))
        lo = sum(len(r) for r in self.row_lists[:mb])
        hi, n = lo + len(self.row_lists[mb]), sum(len(r) for r in self.row_lists)
        # per sample: a row of inputs, and a target row, or T of them (a language model's flat targets)
        return tuple(a[lo * (len(a) // n) : hi * (len(a) // n)] for a in self._all)


@dataclasses.dataclass
class _Pending:
    """A step whose loss and gradient norm are on their way (StepRunner.settle): its index, the backend's
    PendingRead of [norm, clipping factor, skip] and the loss rows, the executor's settle for those rows, and
    the step's result dict and executor result once ``train_step`` has them."""

    step: int
    read: object
    settle_losses: object
    out: dict | None = None
    result: object = None


def agreed_schedule(comm, name: str, num_stages: int, micro_batches: int, virtual_stages: int = 1):
    """Collective over ``comm``: (schedule, its ScheduleStats), checked on ``comm``'s rank 0 only and the stats (or
    the ScheduleError) shared, each rank building the instruction lists itself; both cached per process and
    shape (parallel/schedule.py: ``checked``, ``built``), so a rank checks a shape once at most."""
    text = None
    if comm.Get_rank() == 0:
        try:
            text = json.dumps(dataclasses.asdict(checked(name, num_stages, micro_batches, virtual_stages)[1]))
        except ScheduleError as e:
            text = "error:" + str(e)
    text = bcast_text(comm, text, 0)
    if text.startswith("error:"):
        raise ScheduleError(text[len("error:"):])
    stats = ScheduleStats(**{k: tuple(v) for k, v in json.loads(text).items()})
    return built(name, num_stages, micro_batches, virtual_stages), stats


class StepRunner:
    """Runs this rank's stage of the training schedule and of the evaluation schedule."""

    def __init__(self, *, cfg, run, mesh, backend, part, loss, data, sampler, sync, optim, grads, p2p, transport,
                 tracer, log):
        self.cfg, self.mesh, self.be, self.part, self.loss, self.transport = cfg, mesh, backend, part, loss, transport
        self.data, self.sampler, self.sync, self.optim, self.grads, self.log = data, sampler, sync, optim, grads, log
        self.run = run  # the RunPlan (hpctrain/run_plan.py): micro-batches, schedule, model chunks in effect
        m = run.micro_batches
        self.virtual_stages = v = run.virtual_stages  # model chunks per stage
        self.schedule, self.stats = agreed_schedule(mesh.world, run.schedule, mesh.pp, m, v)
        self.executor = StageExecutor(backend=backend, part=part, loss=loss, stage=mesh.pp_rank, stages=mesh.pp,
                                      p2p=p2p, sync=sync, stats=self.stats,
                                      max_rows=micro_rows(sampler.local, m) * part.positions,
                                      tracer=tracer, virtual_stages=v)
        self.tracer = tracer
        self._graphs_reasons: set = set()  # what _graphs_said has logged
        self._gemm_reasons: set = set()  # the cuBLASLt fallbacks' reasons logged (cuda.gemm)
        self.shard = sync.shard  # ZeRO: the chunks this rank reduces and updates (None: every gradient)
        self._norm_ranges = part.norm_ranges()
        if self.shard is not None:  # each parameter counted once over dp too: by the owner of its chunk
            self._norm_ranges = [r for r in (overlap(n, p) for n in self._norm_ranges for p in self.shard.pieces)
                                 if r[1] > r[0]]
        # whose loss sums count: the last stage's (one tensor-parallel rank of it)
        self.holds_loss = part.is_last and mesh.tp_rank == 0
        self.deterministic = run.deterministic  # parallel/deterministic.py: sums in a fixed order
        if self.deterministic:  # (global tensor index, lo, hi) of what this rank adds to the norm, tensor by tensor
            index = {name: i for i, name in enumerate(part.spec.layout.names)}
            self._norm_tensors = [(index[part.global_names[t.name]], max(lo, t.offset), min(hi, t.end))
                                  for lo, hi in self._norm_ranges for t in part.layout
                                  if t.offset < hi and t.end > lo]
        # a device backend whose gradient norm needs no MPI after the backward (one stage, no tensor parallelism,
        # no ZeRO: the gradients are whole and reduced): clipping and the skip decision are made on the device and
        # the step's loss and norm are read at the next step's optimizer (or by ``settle``), so the host queues the
        # next step while the device finishes this one
        self.defer = (backend.defers_step_values and self.shard is None and part.gather is None
                      and mesh.tp == 1 and mesh.pp == 1 and not self.deterministic)
        self._pending = None  # the deferred step whose values are on their way: _Pending

    def _dropout(self, step: int):
        """What ``_Batch.key`` draws this step's dropout keys from (None: the model does not drop)."""
        if not self.cfg.model.dropout:
            return None
        return self.cfg.train.seed, step, self.sampler.dp_rank * self.sampler.local

    @property
    def grad_scale(self) -> float:
        return self.loss.grad_scale(self.cfg.train.batch_size * self.part.positions, self.part.spec.out_features)

    def train_step(self, step: int, lr: float) -> dict:
        """Run one training step (collective over the mesh); returns this stage's timings and loss sum (with
        ``train.deterministic`` also ``loss_parts``, the sums of this rank's shards in order, for ``global_mean``)."""
        m = self.run.micro_batches
        rows = self.sampler.local_rows(step)
        per = len(rows) // m
        batch = _Batch(self.sampler.reader(self.data), [rows[i * per : (i + 1) * per] for i in range(m)],
                       self.part.positions, at_once=True, dropout=self._dropout(step))
        if self.tracer is not None:
            self.tracer.step = step + 1
        self.sync.start_step()
        tp = self.part.tp
        sent = tp.bytes if tp is not None else 0
        be = self.be
        graphs = getattr(be, "graphs", None)
        allocs, launches = getattr(be, "allocs", 0), getattr(be, "launches", 0)
        replays = graphs.graph_launches if graphs is not None else 0
        with be.step_scope():  # a device backend's arrays from its step arena (backend/arena.py), then its graphs
            r = self.executor.run(self.schedule.stages[self.mesh.pp_rank], batch, grad_scale=self.grad_scale,
                                  on_optimizer_step=lambda: self._finish(step, lr))
        if be.is_device:  # arrays allocated (not from the arena) and kernels launched from Python this step
            r.extra["device_allocs"] = getattr(be, "allocs", 0) - allocs
            r.extra["python_launches"] = getattr(be, "launches", 0) - launches
        self._gemm_said(step, getattr(be, "gemm_fallbacks", None))
        if graphs is not None:  # segments replayed as graphs (backend/cuda/graphs.py); why not, once per reason
            r.extra["graph_launches"] = graphs.graph_launches - replays
            self._graphs_said(step, graphs)
        if tp is not None:  # bytes this rank's tensor-parallel Allreduces carried this step
            r.extra["tp_bytes"] = tp.bytes - sent
        if self.mesh.dp > 1:  # the gradient payload this rank handed to its data-parallel reductions this step
            r.extra["dp_bytes"] = self.sync.sent_bytes
        out = dict(compute=r.busy, comm=r.comm, optim=r.optim, data=r.data, busy=r.busy, wait=r.wait, span=r.span,
                   bubble=r.bubble, loss_sum=r.loss_sum, peak_live=r.peak_live, peak_bytes=r.peak_bytes,
                   kernels=r.kernels, **r.extra)
        if self._pending is not None and self._pending.step == step:  # filled in by settle()
            self._pending.out, self._pending.result = out, r
            out["pending"] = True
        if self.deterministic and self.holds_loss:  # summed in shard order by global_mean, when a line is logged
            out["loss_parts"] = [r.losses[i] for i in range(m)]
        return out

    def _graphs_said(self, step: int, graphs) -> None:
        """One log line per new reason the step's graphs were not replayed (cuda.graphs: the first steps record)."""
        why = graphs.off or graphs.reason
        said = self._graphs_reasons
        if why and why not in said:
            said.add(why)
            what = "off" if graphs.off else "launched one by one"
            self.log(f"cuda.graphs: step {step + 1}'s kernels {what}: {why}")

    def _gemm_said(self, step: int, fallbacks) -> None:
        """One log line per new reason cuBLASLt could not take a product (cuda.gemm; backend/cuda/gemm/)."""
        for why in (fallbacks or {}).keys() - self._gemm_reasons:
            self._gemm_reasons.add(why)
            self.log(f"cuda.gemm: step {step + 1} ran a product in the numba kernels: {why}")

    def _finish(self, step: int, lr: float) -> dict:
        """The OptimizerStep instruction: the tied gradients' sum (``ends_comm``), the norm over the tp ranks and
        the stages, the skip decision, clipping, the update."""
        from mpi4py import MPI

        if self.defer:
            return self._finish_on_device(step, lr)
        cfg, part = self.cfg, self.part
        t0 = time.perf_counter()
        if (part.shared or part.local_ties) and self.shard is None:  # a tied tensor: both halves summed
            sum_tied_grads(self.mesh, self.transport, part, self.grads)  # (both ends wait here; ZeRO: in the sync)
        wait = time.perf_counter() - t0
        # each tensor counted once: a shard on every tensor-parallel rank, a replicated tensor on one
        piece_sums = self._read_step_sums()
        if self.deterministic:  # per tensor, each entry summed from one stage: exact over any pipeline cut
            norm2 = tensor_norm2(piece_sums, self._norm_tensors, len(part.spec.layout))
        else:
            norm2 = np.array([sum(piece_sums.tolist())], dtype=np.float64)
        t0 = time.perf_counter()
        if self.shard is not None:  # ZeRO: each data-parallel rank holds the reduced gradients of its chunks
            self.mesh.dp_comm.Allreduce(MPI.IN_PLACE, norm2, op=MPI.SUM)
        if self.mesh.tp > 1:
            self.mesh.tp_comm.Allreduce(MPI.IN_PLACE, norm2, op=MPI.SUM)
        if self.mesh.pp > 1:  # where a stage waits for the others to finish their backward passes
            self.mesh.pp_comm.Allreduce(MPI.IN_PLACE, norm2, op=MPI.SUM)
        wait += time.perf_counter() - t0
        if self.deterministic:
            norm = norm_of(norm2)
        else:
            norm = math.sqrt(norm2[0]) if norm2[0] >= 0 else float("nan")
        skipped = not math.isfinite(norm)
        if skipped:
            self._stop_or_skip(step, "the gradients contain NaN or Inf", "non-finite gradients")
        else:  # clipping: the optimizer's kernel scales each gradient as it reads it (ZeRO: this rank's chunks)
            coef = min(clip_coefficient(norm, cfg.train.grad_clip), 1.0)
            if norm * coef >= self.optim.SAFE_NORM[self.optim.name]:  # every rank sees the same norm
                skipped = self._overflow(step, coef)
        if not skipped:
            if self.shard is None or part.gather is not None:  # zero 3: each unit gathers in its forward
                self.optim.step(lr, grad_scale=coef)
                if part.gather is not None:  # nothing gathered before the step outlives it (stale values)
                    part.gather.release_all()
            else:  # ZeRO: each bucket's updated chunks to every rank, as soon as this rank's chunk is updated
                params = self.optim.params.data
                self.optim.step(lr, after=lambda i: self.sync.gather_bucket(i, params), grad_scale=coef)
                self.sync.finish_gather()
            if part.shared or part.local_ties:  # a tied tensor: its owner updated it; the replica receives it
                if part.gather is not None:  # zero 3: both ends whole for the copy, this rank's chunks kept after
                    with part.gather.tied(tied_ranges(part)):
                        refresh_replicas(self.mesh, self.transport, part, self.optim.params)
                else:
                    refresh_replicas(self.mesh, self.transport, part, self.optim.params)
        return dict(grad_norm=norm, skipped=skipped, wait=wait)

    def _finish_on_device(self, step: int, lr: float) -> dict:
        """``_finish`` with nothing read: the norm's pieces, the clipping factor and the skip decision stay on the
        device (``clip_gate``), the update applies them (``gate``), and they and the loss rows are copied back
        without a wait (``read_later``). The one wait is the previous step's values (``settle``)."""
        part, be, data = self.part, self.be, self.grads.data
        t0 = time.perf_counter()
        if part.local_ties:  # a tied tensor within this rank: both halves summed
            sum_tied_grads(self.mesh, self.transport, part, self.grads)
        self.settle()  # the previous step's loss and norm: long computed, since the device runs in order
        wait = time.perf_counter() - t0
        pieces = be.empty((len(self._norm_ranges),), np.float64)
        for i, (lo, hi) in enumerate(self._norm_ranges):
            be.sum_squares(data if (lo, hi) == (0, data.size) else data[lo:hi], into=pieces[i : i + 1])
        gate = be.empty((3,), np.float64)
        be.clip_gate(pieces, max_norm=self.cfg.train.grad_clip, safe_norm=self.optim.SAFE_NORM[self.optim.name],
                     into=gate)
        self.optim.step(lr, gate=gate)  # a skipped step leaves the parameters and the state as they were
        if part.local_ties:
            refresh_replicas(self.mesh, self.transport, part, self.optim.params)
        rows, settle_losses = self.executor.take_losses()
        read = be.read_later(gate, *(() if rows is None else (rows,)))
        self._pending = _Pending(step, read, settle_losses)
        return dict(grad_norm=float("nan"), skipped=False, wait=wait)

    def settle(self) -> None:
        """The deferred step's loss and gradient norm read (a wait only if the device has not finished it) and
        put into that step's ``train_step`` result; a skipped step is reported at its own step number, and
        without ``train.skip_nonfinite`` a non-finite one stops the run as ``_finish`` does (collective: every
        rank reads the same norm). Nothing to do when no step is pending."""
        p, self._pending = self._pending, None
        if p is None:
            return
        host = p.read.wait()
        norm, skip = float(host[0][0]), int(host[0][2])
        p.settle_losses(host[1] if len(host) > 1 else None)
        if p.out is not None:
            p.out.update(grad_norm=norm, skipped=bool(skip), loss_sum=p.result.loss_sum)
            p.out.pop("pending", None)
        if not skip:
            return
        self.optim.step_count -= 1  # the device left the update undone: the step count follows
        if skip == 1:
            self._stop_or_skip(p.step, "the gradients contain NaN or Inf", "non-finite gradients")
        else:
            what = f"the gradient norm {norm:.3g} could overflow the optimizer's state in float32"
            self._stop_or_skip(p.step, what, what)

    def _stop_or_skip(self, step: int, what: str, short: str) -> None:
        """A step whose gradients cannot be applied (``what``): the run stops with a NonFiniteError (collective:
        every rank saw the same norm, rank 0 raises it, the others leave quietly), or with
        ``train.skip_nonfinite`` the step is skipped and said (``short``)."""
        if not self.cfg.train.skip_nonfinite:
            if self.mesh.rank != 0:
                raise QuietExit(0)
            error = NonFiniteError(f"step {step + 1}: {what}; lower optim.lr, set train.grad_clip, or set "
                                   "train.skip_nonfinite = true to skip such steps")
            error.collective = True
            raise error
        self.log(f"step {step + 1}: {short}, step skipped")

    def _read_step_sums(self) -> np.ndarray:
        """The step's one wait for a device: the sums of squares of this rank's norm pieces, and the last stage's
        loss rows (handed to the executor), computed on the backend and read together. Returns the piece sums,
        in the order of the norm ranges."""
        be, data = self.be, self.grads.data
        ranges = [(lo, hi) for _, lo, hi in self._norm_tensors] if self.deterministic else self._norm_ranges
        pieces = be.empty((len(ranges),), np.float64)
        for i, (lo, hi) in enumerate(ranges):
            be.sum_squares(data if (lo, hi) == (0, data.size) else data[lo:hi], into=pieces[i : i + 1])
        loss_rows = self.executor.pending_loss_rows()
        host = be.read_host(pieces, *(() if loss_rows is None else (loss_rows,)))
        if loss_rows is not None:
            self.executor.settle_losses(host[1])
        return host[0]

    def _overflow(self, step: int, grad_scale: float) -> bool:
        """A finite gradient so large that the update would overflow the optimizer's float32 state (Adam squares
        it): found now, at the step it appears, not at the next checkpoint. Every rank checks its pieces and
        all agree; skipped with ``train.skip_nonfinite``, else the run stops naming the tensor (collective)."""
        from ..parallel.agree import agree_error, raise_agreed

        name, slot, gmax = self.optim.overflow(grad_scale)
        problem = None
        if name:
            problem = NonFiniteError(
                f"step {step + 1}: the gradient of {name} (|g| up to {gmax:.3g}) would overflow the optimizer's "
                f"{slot} in float32; lower optim.lr, set train.grad_clip, or look for huge values in the inputs")
        bad, error = agree_error(self.mesh.world, problem)
        if error is None:
            return False
        if not self.cfg.train.skip_nonfinite:
            raise_agreed(self.mesh.world, bad, error)
        self.log(f"{str(error).split('; lower')[0]}: step skipped")
        return True

    def _ordered_over_dp(self, mine: list[float]) -> float:
        """The data-parallel group's values (this rank's ``mine``, every rank its count) gathered in rank order and
        summed in one fixed tree (``ordered_sum``), on dp rank 0; 0.0 elsewhere (collective over dp)."""
        comm = self.mesh.dp_comm
        counts = np.empty(comm.Get_size(), dtype=np.int64)  # buffer calls: nothing pickled
        comm.Allgather(np.array([len(mine)], dtype=np.int64), counts)
        counts = counts.tolist()
        out = np.empty(sum(counts), dtype=np.float64)
        comm.Allgatherv(np.asarray(mine, dtype=np.float64), [out, counts])
        return ordered_sum(out) if self.mesh.dp_rank == 0 else 0.0

    def global_mean(self, local_sum: float, count: int, parts=None) -> float:
        """The loss sum of the last stages' ranks over the world, divided by ``count`` (collective). Deterministic:
        the sum of ``parts``, this rank's shard sums of a step (``train_step``'s ``loss_parts``), in shard order."""
        from mpi4py import MPI

        if self.deterministic and self.holds_loss:  # the data-parallel group's shards in one fixed tree
            local_sum = self._ordered_over_dp(parts or [])
        buf = np.array([local_sum if self.holds_loss else 0.0], dtype=np.float64)
        self.mesh.world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return float(buf[0] / count)

    def evaluate(self, split: str = "val", *, count: bool = False, batches: int = 0) -> dict:
        """Loss (and accuracy) over the validation split (``split = "all"``: every sample of the data file),
        forward-only through the pipeline (collective); ``count``: with the number of samples; ``batches``
        (``train.eval_batches``, nanoGPT's eval_iters): only the split's first ``batches`` × batch_size samples.

        Each data-parallel rank takes a contiguous share of the split, in chunks of one training micro-batch (the
        most the pipeline's receive buffers hold).
        """
        from mpi4py import MPI

        mesh, data = self.mesh, self.data
        first, end = (0 if split == "all" else data.n_train), data.n_train + data.n_val
        if batches and split != "all":
            end = min(end, first + batches * self.cfg.train.batch_size)
        chunk = micro_rows(self.sampler.local, self.run.micro_batches)
        if self.deterministic:  # chunks of one shard cut from the whole split, then dealt out: the same everywhere
            chunks = [np.arange(s, min(end, s + chunk)) for s in range(first, end, chunk)]
            row_lists = chunks[len(chunks) * mesh.dp_rank // mesh.dp : len(chunks) * (mesh.dp_rank + 1) // mesh.dp]
        else:
            lo = first + (end - first) * mesh.dp_rank // mesh.dp
            hi = first + (end - first) * (mesh.dp_rank + 1) // mesh.dp
            row_lists = [np.arange(s, min(hi, s + chunk)) for s in range(lo, hi, chunk)]
        sums = np.zeros(3, dtype=np.float64)  # loss sum, correct, rows
        r = None
        if row_lists:
            m = len(row_lists)
            schedule, _ = agreed_schedule(mesh.pp_comm, "forward-only", mesh.pp, m,  # one pipeline: the same m
                                          self.virtual_stages)
            r = self.executor.run(schedule.stages[mesh.pp_rank],
                                  _Batch(data, row_lists, self.part.positions))
            if self.holds_loss:
                sums[:] = r.loss_sum, r.correct, r.rows
        if self.deterministic and self.holds_loss:
            sums[0] = self._ordered_over_dp([r.losses[i] for i in range(len(row_lists))] if r is not None else [])
        mesh.world.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        per = self.part.spec.out_features if self.loss.name == "mse" else 1
        result = {"val_loss": float(sums[0] / (sums[2] * per))}
        if count:
            result["samples"] = int(sums[2]) // self.part.positions
        if self.loss.classification:
            result["val_accuracy"] = float(sums[1] / sums[2])
        return result
