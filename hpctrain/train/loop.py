"""The training loop: steps, metrics, progress, evaluation, checkpoints, the trace.

    hpctrain train jobs/configs/digits.toml                     # one process
    mpiexec -n 2 hpctrain train jobs/configs/digits.toml        # data parallel on 2 ranks
    mpiexec -n 2 hpctrain train jobs/configs/digits-pp2.toml    # a 2-stage pipeline
    srun hpctrain train jobs/configs/digits.toml                # under Slurm

``Trainer(cfg)`` (or ``Trainer(cfg, mesh=Mesh(...))`` over a communicator of your own) is
collective over the mesh's world communicator: every rank builds it and calls ``run()``,
then ``close()``. From Python::

    from hpctrain import Trainer, load_config
    trainer = Trainer(load_config("jobs/configs/digits.toml", ["train.steps=100"]))
    trainer.run()
    trainer.close()

Bad input found while building (config, data,
layout, schedule) is reported once by the lowest failing rank and every rank leaves
together (parallel/agree.py). Each rank holds its pipeline stage's part of the model;
``train_step`` runs one step of the checked schedule (train/step.py).
"""

from __future__ import annotations

import copy
import time

import numpy as np

from .. import checkpoint as ckpt
from .._memory import keep_freed_memory
from ..errors import ConfigError, HpctrainError, NonFiniteError
from ..parallel.agree import QuietExit, check_same_everywhere, run_everywhere
from ..parallel.data_parallel import GradSync
from ..parallel.deterministic import ShardTree
from ..parallel.sharding import gather_flat, gather_shards, stage_ranges
from ..parallel.tied import sum_tied_grads
from ..parallel.transport import PointToPoint
from ..parallel.watch import Diagnostics, enabled_by_env
from ..parallel.zero import reduce_choice
from ..parallel.zero3 import gathered_whole
from ..optim import lr_at
from ..run_plan import RunPlan
from . import startup
from .checkpointing import Checkpointer
from .progress import Progress, status_line_wanted
from .report import finished_line, layout_line, log_line, run_summary, start_notes
from .memory import gather_memory, rank_memory, summary as memory_summary
from .metrics import MetricsFile, Window
from .mfu import Peak
from .step import StepRunner
from .stop import StopFlag
from .trace import Tracer

__all__ = ["Trainer"]


class Trainer:
    """One training job over a mesh. Building it, ``run()``, ``train_step``, ``evaluate``,
    ``save_checkpoint`` and ``state_dict`` are collective over ``mesh.world``.

    ``log`` receives rank 0's progress lines (other ranks log nothing); by default each is printed
    and flushed at once, so a log file or a Slurm output file shows progress as it happens, and
    nothing is lost when the job is killed (stdout is block-buffered whenever it is not a terminal).

    ``stop``: a StopFlag installed earlier (the command line installs one at entry, so a signal during
    start-up is recorded too); by default the Trainer installs its own and restores the old handlers when
    ``run()`` ends (a later ``run()`` installs them again) and in ``close()``.

    ``on_record``: called on rank 0 with each metrics record as a dict, the same ones ``train.metrics``
    gets (training lines, evaluations, the memory lines), whether or not a metrics file is written: the
    hook for TensorBoard, W&B or a CSV of your own::

        writer = tensorboardX.SummaryWriter("runs/x")
        Trainer(cfg, on_record=lambda r: [writer.add_scalar(k, v, r["step"]) for k, v in r.items()
                                          if isinstance(v, float)])
    """

    # what this rank runs and trains, made once at start-up (train/startup.py: ``RankParts``, ``RankState``)
    be, cuda_aware, transport, model, stages, tensor, part, loss, data, sampler = (
        startup.holder_property("parts", name) for name in startup.PART_FIELDS)
    zero, shard, grad_memory, params, grads, optim = (
        startup.holder_property("state", name) for name in startup.STATE_FIELDS)

    def __init__(self, cfg, *, mesh=None, log=None, stop=None, on_record=None):
        self.on_record = on_record
        # SIGTERM/SIGUSR1 are recorded, never fatal, from here to close() (train/stop.py)
        self._own_stop = stop is None
        self._stop = StopFlag() if stop is None else stop
        self._lock = None  # world rank 0's lock on checkpoint.dir, held until close()
        self._failed_alone = False  # run() raised on this rank alone: close() does nothing collective
        self._closed = False
        self._lagging = False  # inside run()'s loop: a device step's values are read a step late (train/step.py)
        self._made_mesh = None  # the Mesh built here from cfg.parallel (no mesh given): freed by close()
        try:
            self._build(cfg, mesh, log)
        except BaseException as e:
            self._undo_build(agreed=isinstance(e, QuietExit) or getattr(e, "collective", False))
            raise

    def _undo_build(self, *, agreed: bool) -> None:
        """A failed construction gives back what it took: signal handlers, the watchdog, the gradient sync's
        thread, the data file, the lock, and (when every rank failed together, so that freeing it is safe) the
        mesh it made; a script that catches the error and goes on leaks no communicators."""
        self._restore_signals()
        for name in ("diag", "sync"):  # threads and duplicates: not collective
            if getattr(self, name, None) is not None:
                getattr(self, name).close()
        parts = getattr(self, "parts", None)
        if parts is not None:
            parts.data.close()
        try:
            self._free_grad_memory()
        except Exception:  # a broken device: the build's own error is the one to report
            pass
        if agreed:  # communicators are freed together
            if getattr(self, "_p2p", None) is not None:
                self._p2p.free()
            if self._made_mesh is not None:
                self._made_mesh.free()
        self._release_lock()

    def _build(self, cfg, mesh, log):
        """Every rank builds the same Trainer, step by step; each step that can fail on some ranks only is agreed
        (``run_everywhere``), so a bad input is one error from the lowest failing rank."""
        mesh = self._mesh_for(cfg, mesh)
        self.rank0 = mesh.rank == 0
        self.log = (log or log_line) if self.rank0 else (lambda *a, **k: None)
        # the run's shape on this mesh, derived once (hpctrain/run_plan.py): ZeRO in effect, micro-batches, ...
        self.run_plan = run = run_everywhere(mesh.world, lambda: RunPlan.for_mesh(cfg, mesh))
        for line in run.notes(cfg):  # train.deterministic: its micro-batches are shards / dp
            self.log(line)
        cfg = run.resolved(cfg)
        self.cfg, self.mesh = cfg, mesh
        self.diag = None
        mesh = self._watch(cfg, mesh)
        keep_freed_memory()  # a step's activations reuse the last step's memory (hpctrain/_memory.py)
        log = self.log
        run_everywhere(mesh.world, (lambda: startup.prepare_data(cfg, log)) if self.rank0 else lambda: None)
        self.parts = run_everywhere(mesh.world, lambda: startup.build(cfg, run, mesh, log))
        startup.scan_data(mesh, self.parts.data, log)  # every value of the data file, or a record of a clean scan
        # one job per checkpoint folder: rank 0 locks it before anything in it is read or written
        self._lock = run_everywhere(mesh.world, (lambda: startup.lock_checkpoint_dir(cfg, log)) if self.rank0
                                    else lambda: None)
        self._check_same_everywhere(cfg, mesh)
        self.state = run_everywhere(mesh.world, lambda: startup.make_state(cfg, run, mesh, self.parts))
        # what start-up's later steps and the checkpoints read; its log is the trainer's (run() wraps it)
        rank = startup.Rank(cfg=cfg, run=run, mesh=mesh, log=lambda *a, **k: self.log(*a, **k), parts=self.parts,
                            state=self.state)
        self.step = startup.load_start(rank)  # a checkpoint (each rank its own pieces), weights or a fresh init
        zero_reduce, timed = self._make_sync(cfg, mesh)
        if self.state.gather is not None:  # zero = 3: evaluation gathers the whole model once (parallel/zero3.py)
            self.evaluate = gathered_whole(self.state.gather, self.evaluate)
        self.saver = Checkpointer(rank)
        self.tracer = Tracer(mesh) if cfg.train.trace else None
        self._p2p = p2p = PointToPoint(comm=mesh.pp_comm, transport=self.transport, diag=self.diag) \
            if mesh.pp > 1 else None
        self.runner = run_everywhere(mesh.world, lambda: StepRunner(
            cfg=cfg, run=run, mesh=mesh, backend=self.be, part=self.part, loss=self.loss, data=self.data,
            sampler=self.sampler, sync=self.sync, optim=self.optim, grads=self.grads, p2p=p2p,
            transport=self.transport, tracer=self.tracer,
            log=self.log))
        self.log(layout_line(self))
        # MFU's denominator, on the rank that logs (a CPU's is measured: a moment of BLAS at start-up)
        self.peak = Peak.of(self.be, cfg.train.peak_tflops, run.precision) if self.rank0 and cfg.train.steps else None
        if self.peak is not None:
            self.log(f"MFU against {self.peak.flops / 1e12:,.3g} TFLOP/s a rank ({self.peak.source})"
                     if self.peak.flops else f"no MFU: {self.peak.source}")
        for line in start_notes(self, zero_reduce, timed):
            self.log(line)

    def _mesh_for(self, cfg, mesh):
        """The mesh given, or one made here from ``cfg.parallel`` over COMM_WORLD (freed by close()); a
        config this Trainer cannot run is refused first, on every rank alike."""
        from mpi4py import MPI

        if cfg.parallel.mode != "sync":  # every rank alike, before any communicator: one error, as build errors
            def refuse():
                raise ConfigError(f'parallel.mode = "{cfg.parallel.mode}": Trainer trains synchronously; the '
                                  "parameter server is hpctrain.train.async_ps.AsyncTrainer(cfg) (what hpctrain "
                                  "train runs for this mode)")

            run_everywhere(mesh.world if mesh is not None else MPI.COMM_WORLD, refuse)
        self._own_mesh = mesh is None  # made here from cfg.parallel over COMM_WORLD; freed by close()
        if mesh is None:
            from ..parallel.mesh import Mesh, resolve_layout

            p = cfg.parallel  # a misfit is one error from the lowest rank, before any communicator is made
            run_everywhere(MPI.COMM_WORLD, lambda: resolve_layout(MPI.COMM_WORLD.Get_size(), p.dp, p.pp, p.tp))
            mesh = self._made_mesh = Mesh(dp=p.dp, pp=p.pp, tp=p.tp)
        return mesh

    def _watch(self, cfg, mesh):
        """With train.debug_collectives, train.collective_timeout or HPCTRAIN_DEBUG_COLLECTIVES: the watchdog
        (parallel/watch.py) on this trainer's own copy of the mesh (the caller's Mesh stays as it was)."""
        t = cfg.train
        if t.debug_collectives or t.collective_timeout or enabled_by_env():  # parallel/watch.py
            self.diag = run_everywhere(mesh.world, lambda: Diagnostics(
                mesh.world, fingerprints=t.debug_collectives or enabled_by_env(), timeout=t.collective_timeout))
            self.mesh = mesh = copy.copy(mesh)  # this trainer's view of it: the caller's Mesh stays as it was
            mesh.watch(self.diag)
        return mesh

    def _check_same_everywhere(self, cfg, mesh) -> None:
        """Config, layouts and backend agreed by every rank before any buffer is exchanged (collective)."""
        check_same_everywhere(mesh.world, "config", cfg.to_toml())
        check_same_everywhere(mesh.world, "parameter layout", self.model.layout.describe(),
                              self.model.layout.first_difference)
        check_same_everywhere(mesh.dp_comm, "stage layout", self.part.layout.describe(),
                              self.part.layout.first_difference)
        # the gradient sync takes a different sequence of MPI calls on a device than on the host
        check_same_everywhere(mesh.world, "backend", self.be.name,
                              lambda theirs: f"{self.be.name} here, {theirs} on rank 0 (train.backend = "
                                             f"{cfg.train.backend!r}; every rank must run the same backend)")
        startup.agree_gemm(self.be, mesh.world, self.log)  # one GEMM provider on every rank (cuda.gemm)

    def _make_sync(self, cfg, mesh):
        """``self.sync``, the gradient sync over dp (parallel/data_parallel.py); returns how ZeRO sums a bucket
        and the start-up timings behind an "auto" choice (parallel/zero.py: ``reduce_choice``)."""
        run = self.run_plan
        tied = None  # ZeRO: tensors tied across stages are summed over their two ends before the scatter
        if self.shard and self.part.shared:
            tied = ([(self.part.layout[n].offset, self.part.layout[n].end) for n in self.part.shared],
                    lambda: sum_tied_grads(mesh, self.transport, self.part, self.grads))
        zero_reduce, timed = "reduce_scatter", None  # ZeRO: how a bucket is summed (parallel/zero.py)
        if self.shard is not None and mesh.dp > 1:
            zero_reduce, timed = run_everywhere(mesh.world, lambda: reduce_choice(
                cfg.parallel.zero_reduce, mesh.dp_comm, max((hi - lo for lo, hi in self.shard.buckets), default=1),
                device=self.be.is_device, agree=mesh.world))
        self.sync = run_everywhere(mesh.world, lambda: GradSync(  # staging buffers: a device may run out
            comm=mesh.dp_comm, transport=self.transport, grads=self.grads, bucket_mb=cfg.parallel.bucket_mb,
            overlap=cfg.parallel.overlap, diag=self.diag, shard=self.shard, release=self.grad_memory, tied=tied,
            tree=ShardTree(self.be, self.grads.data, run.micro_batches) if run.deterministic else None,
            allreduce=zero_reduce == "allreduce", reduce_dtype=run.reduce_dtype))
        return zero_reduce, timed

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> tuple[dict, dict] | None:
        """Full, unsharded parameters and optimizer slots on world rank 0, None elsewhere (collective).

        Each buffer is gathered from the stages one at a time (parallel/sharding.py). After ``close()`` too, over
        a mesh the caller gave (the buffers are still here).
        """
        if self._own_mesh:
            self._check_open("state_dict")
        ranges = stage_ranges(self.model, self.stages, self.mesh.pp)
        out = []
        for buf in [self.params] + list(self.optim.slots.values()):  # a tied tensor's replica stays behind
            local = self.be.to_host(buf.data)
            if buf is self.params and self.state.gather is not None:  # zero 3: its chunks are all it holds
                local = np.concatenate([local[a:b] for a, b in self.shard.pieces])
            if (buf is not self.params or self.state.gather is not None) and self.shard:  # ZeRO: to dp rank 0
                local = gather_shards(self.mesh.dp_comm, local, self.shard)
                if local is None:  # gather_flat would return None here too: only dp rank 0 speaks for a stage
                    out.append(None)
                    continue
            full = gather_flat(self.mesh, local[: self.part.owned_size], ranges, self.model.layout.size, self.part)
            out.append(None if full is None else self.model.layout.unpack(full))
        if not self.rank0:
            return None
        return out[0], dict(zip(self.optim.slots, out[1:]))

    def save_checkpoint(self, *, background: bool = False) -> str:
        """Write a sharded checkpoint: every rank its own pieces, world rank 0 the index that commits the set
        (collective; train/checkpointing.py). ``background``: a thread writes this rank's shard while training
        goes on, and a later step commits it. Returns the index path on rank 0 once committed, else ""."""
        self._check_open("save_checkpoint")
        if not self.cfg.checkpoint.dir:
            return ""
        cfg, mesh = self.cfg, self.mesh
        self.runner.settle()  # a deferred step's skip decision, and so the step count, first (train/step.py)
        epoch, position = self.sampler.position(self.step)
        state = ckpt.CheckpointState(
            step=self.step, epoch=epoch, data_position=position, config_text=cfg.to_toml(),
            layout=dict(mesh.layout), params={}, optim_name=self.optim.name,
            optim_step=self.optim.step_count, slots={slot: {} for slot in self.optim.slots},
            rng={"data_seed": cfg.data.seed, "shuffle": cfg.data.shuffle, "init_seed": cfg.train.seed},
            vocabulary=getattr(self.data, "vocabulary", ""), tokenizer=getattr(self.data, "tokenizer", ""),
            data_fingerprint=self.data.fingerprint() if self.rank0 else "")  # taken at start-up (load_start)
        path = self.saver.save(state, background=background)
        return path if self.rank0 else ""

    # ------------------------------------------------------------------ the loop

    def train_step(self, step: int, lr: float) -> dict:
        """One optimizer step on global batch ``step`` at learning rate ``lr`` (collective); this rank's timings,
        its loss and gradient norm read (``run`` reads a device's a step late where it can: train/step.py)."""
        self._check_open("train_step")
        timing = self.runner.train_step(step, lr)
        if not self._lagging:  # outside run()'s loop the values are read now
            self.runner.settle()
        return timing

    def evaluate(self) -> dict:
        """Loss (and accuracy) over the validation split, its first ``train.eval_batches`` batches where that is set
        (collective)."""
        self._check_open("evaluate")
        batches = self.cfg.train.eval_batches
        if self.tracer is None:
            return self.runner.evaluate(batches=batches)
        self.tracer.evaluating = True  # its spans are marked as evaluation's in the trace
        try:
            return self.runner.evaluate(batches=batches)
        finally:
            self.tracer.evaluating = False

    def run(self):
        """Train until ``train.steps`` (collective: every rank calls it). Returns the last metrics (on every rank).

        An error this rank raises alone (not one every rank agreed on) leaves the other ranks anywhere, most
        likely waiting for this one in a collective: ``close()`` then does nothing collective (a checkpoint
        still being written is abandoned, never committed), so the error reaches the caller, which ends the job
        (the CLI: ``abort_world``), instead of waiting in a commit no other rank joins."""
        self._check_open("run")
        if self._own_stop:
            self._stop.install()  # after an earlier run() gave the handlers back
        try:
            return self._run()
        except BaseException as e:
            if not (isinstance(e, QuietExit) or getattr(e, "collective", False)):
                self._failed_alone = True
            raise
        finally:  # a Trainer made without a stop flag gives the signals back when run() ends (the command line
            self._restore_signals()  # keeps its own flag's until the process exits)

    def _run(self):
        """``run``'s loop.

        SIGTERM and SIGUSR1 (what Slurm sends before a time limit) stop the run at the next step
        boundary, after a checkpoint when ``checkpoint.dir`` is set. With ``train.skip_nonfinite``,
        ``train.max_skipped_steps`` non-finite steps in a row stop it with a NonFiniteError and no
        checkpoint; a checkpoint due during a shorter run of skipped steps waits for the next finite step.
        """
        cfg, t = self.cfg, self.cfg.train
        if t.steps == 0 and self.step == 0:
            self.log("train.steps = 0: nothing to train" + (f" (checkpoint.init {cfg.checkpoint.init} loaded)" if
                                                             cfg.checkpoint.init else "")
                     + "; to evaluate a checkpoint on a file: hpctrain eval CHECKPOINT --data FILE")
        if self.step >= t.steps and self.step > 0:  # resumed at or past the end: nothing trained or written
            self.log(finished_line(cfg, self.step))
            return self._log_eval(MetricsFile("", on_record=self.on_record if self.rank0 else None)) \
                if self.data.n_val else {}
        metrics = MetricsFile(t.metrics if self.rank0 else "", resume_step=self.step,
                              on_record=self.on_record if self.rank0 else None,
                              tensorboard=t.tensorboard if self.rank0 else "")
        window = Window()
        # an ETA for the log lines; on a terminal, a status line between them (train/progress.py)
        self.progress = Progress(t.steps, self.step, live=self.rank0 and self.log is log_line
                                 and status_line_wanted(t.progress))
        plain_log, self.log = self.log, self.progress.wrap(self.log)
        run_began, first_step = time.perf_counter(), self.step  # for the end-of-run line
        try:
            self._lagging = True
            last, saved_at = self._steps(metrics, window)
        finally:
            self._lagging = False
            metrics.close()
            self.progress.clear()  # an error line on its way must not land on the status line
        self._wrap_up(saved_at, plain_log)
        self.log(run_summary(cfg, first_step, self.step, time.perf_counter() - run_began, last))
        return last

    def _steps(self, metrics, window) -> tuple[dict, int]:
        """Steps until ``train.steps`` or a stop signal, with their log lines, evaluations and checkpoints
        (collective). Returns the last metrics and the step of the last checkpoint written (-1: none)."""
        cfg, t, stop = self.cfg, self.cfg.train, self._stop
        last, saved_at = {}, -1
        first_step, peak_activations = self.step, 0
        skipped = 0  # non-finite steps skipped in a row (every rank sees the same skip decision)
        behind = []  # (step, timing) whose skip decisions are still to be counted (read a step late)
        counted = self.step  # the last step counted in ``skipped``
        deferred = False  # a checkpoint fell due while steps were being skipped
        stopping = stop.any_rank(self.mesh.world)  # a signal while the job was starting (agreed by all)
        if stopping:
            self.log(f"signal {stop.name} received during start-up: stopping at step {self.step}")
        while self.step < t.steps and not stopping:
            lr = lr_at(cfg.optim, self.step, t.steps)
            if self.diag is not None:
                self.diag.step = self.step + 1  # what the watchdog reports: "step N" from here to its end checks
            timing = self.train_step(self.step, lr)
            self.step += 1
            self.progress.advance(self.step)
            peak_activations = max(peak_activations, timing["peak_bytes"])
            if self.step == first_step + 1:  # what each rank holds, once the first step has allocated it
                self._log_memory(metrics, peak_activations, say=True)
            log = self.step % t.log_every == 0 or self.step == t.steps
            evaluate = self.data.n_val and ((t.eval_every and self.step % t.eval_every == 0) or self.step == t.steps)
            behind.append((self.step, timing))
            if log or evaluate or deferred or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                self.runner.settle()  # else a device's values arrive with the next step's (train/step.py)
            while behind and "pending" not in behind[0][1]:  # steps whose skip decision has arrived, in order
                counted, done = behind.pop(0)
                skipped = skipped + 1 if done["skipped"] else 0
            window.add(timing)
            if log:
                last = self._log_train(window, timing, lr, metrics)
            if skipped >= t.max_skipped_steps:
                self._diverged(skipped, counted)
            if evaluate:
                began = time.perf_counter()
                last.update(self._log_eval(metrics))
                window.exclude(time.perf_counter() - began)  # samples/s counts training steps only
            deferred, saved = self._checkpoint_if_due(skipped, deferred, window)
            if saved:
                saved_at = self.step
            self.saver.poll()  # a checkpoint written in the background is committed once every shard is
            if stop.any_rank(self.mesh.world):
                self.runner.settle()
                if window.steps:  # the steps since the last training line get theirs (collective)
                    last.update(self._log_train(window, timing, lr, metrics))
                self.log(f"signal {stop.name} received: stopping at step {self.step}"
                         + ("" if cfg.checkpoint.dir else " (no checkpoint: checkpoint.dir is empty)"))
                break
        if self.step > first_step + 1:
            self._log_memory(metrics, peak_activations, say=False)
        return last, saved_at

    def _checkpoint_if_due(self, skipped: int, deferred: bool, window) -> tuple[bool, bool]:
        """The checkpoint of ``checkpoint.every`` (collective), unless steps are being skipped: these weights gave
        non-finite gradients, so the older checkpoints are kept and this one waits for the next finite step.
        Returns (deferred, written)."""
        c = self.cfg.checkpoint
        if not (deferred or (c.every and self.step % c.every == 0)):
            return deferred, False
        if skipped:
            if not deferred:
                self.log(f"step {self.step}: checkpoint deferred, {skipped} non-finite step(s) skipped "
                         "in a row; it is written after the next finite step")
            return True, False
        began = time.perf_counter()
        self.save_checkpoint(background=c.async_)
        window.exclude(time.perf_counter() - began)
        return False, True

    def _wrap_up(self, saved_at: int, plain_log) -> None:
        """The end of a run (collective): the checkpoint in flight committed, the last one written, the trace."""
        t = self.cfg.train
        self._stop.shield_interrupts()  # a second signal or a Ctrl-C during the stop checkpoint: recorded, not fatal
        try:
            self.saver.finish()  # the last checkpoint and the stop checkpoint are written before run() returns
            if saved_at != self.step:
                self.save_checkpoint()
            if self.tracer is not None:
                spans = self.tracer.write(t.trace)
                self.log(f"trace {t.trace} written ({spans:,} events)")
            # no rank leaves before rank 0's files are durable: a launcher that sees one rank exit, or a
            # signal that kills a rank that has left run(), would otherwise end rank 0 mid-write
            self.mesh.world.Barrier()
        finally:
            self.progress.clear()
            self.log = plain_log

    def _log_memory(self, metrics, peak_activations: int, *, say: bool) -> None:
        """Every rank's figures (train/memory.py) into the metrics file; one log line when ``say`` (collective)."""
        records = gather_memory(self.mesh.world, rank_memory(self, peak_activations))
        if records is None:
            return
        metrics.write(dict(step=self.step, memory=records))
        if say:
            self.log(memory_summary(records))

    def _diverged(self, skipped: int, step: int):
        """``train.max_skipped_steps`` in a row, the last at ``step``: raise on rank 0, leave quietly elsewhere; no
        checkpoint is written (one still in flight, of weights from before these steps, is committed first)."""
        self.saver.finish()
        if not self.rank0:
            raise QuietExit(0)
        c = self.cfg.checkpoint
        found = ckpt.list_checkpoints(c.dir) if c.dir else []
        kept = f"; the newest checkpoint, {found[-1][1]}, is kept" if found else ""
        error = NonFiniteError(f"step {step}: {skipped} non-finite steps skipped in a row (train.max_skipped_steps"
                               f" = {self.cfg.train.max_skipped_steps}): the run diverged; no checkpoint written"
                               f"{kept}; lower optim.lr or set train.grad_clip")
        error.collective = True  # every rank took the same skip decisions
        raise error

    def _log_train(self, window, timing, lr, metrics):
        B = self.cfg.train.batch_size
        per_row = self.model.out_features if self.loss.name == "mse" else self.model.positions
        loss = self.runner.global_mean(timing["loss_sum"], B * per_row, timing.get("loss_parts"))
        stages = self._stage_figures(window)
        means, rate = window.flush(B)
        record = dict(step=self.step, loss=loss, lr=lr, samples_per_s=rate, grad_norm=timing["grad_norm"],
                      **{f"{k}_s": means[k] for k in ("compute", "comm", "optim", "data")})
        for key in ("tp_bytes", "dp_bytes"):  # this rank's bytes, summed over the pipeline stages (collective)
            if key in timing:
                record[key] = self._summed_over_stages(timing[key])
        # a device backend's, this rank's, the last step's
        for key in ("device_allocs", "python_launches", "graph_launches"):
            if key in timing:
                record[key] = timing[key]
        if self.model.positions > 1:  # a language model: every position of a sample is a token trained on
            record["tokens_per_s"] = rate * self.model.positions
        mfu = self.peak.mfu(rate, self.model.training_flops(), self.mesh.size) if self.peak else None
        if mfu is not None:
            record["mfu"] = mfu
        if stages:
            record["stages"] = stages
        if timing["skipped"]:
            record["skipped"] = True
        metrics.write(record)
        speed = (f"{record['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in record else f"{rate:,.0f} samples/s")
        if mfu is not None:
            speed += f"  MFU {mfu:.1%}"
        self.log(f"step {self.step:>6}/{self.cfg.train.steps}  loss {loss:.4f}  lr {lr:.3g}  {speed}  "
                 f"(compute {means['compute'] * 1e3:.1f} ms, comm wait {means['comm'] * 1e3:.1f} ms, "
                 f"optim {means['optim'] * 1e3:.1f} ms"
                 + (", bubble " + " ".join(f"{s['bubble']:.0%}" for s in stages) if stages else "")
                 + f")  ETA {self.progress.eta()}")
        self.progress.summary = f"loss {loss:.4f}  {speed}"
        return record

    def _summed_over_stages(self, count: int) -> int:
        """``count`` summed over this rank's pipeline stages (collective over pp_comm when pp > 1)."""
        total = np.array([count], dtype=np.int64)
        if self.mesh.pp > 1:
            from mpi4py import MPI

            self.mesh.pp_comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return int(total[0])

    def _stage_figures(self, window) -> list[dict]:
        """Per-stage busy/wait seconds, bubble and peaks, from data-parallel rank 0 of each stage (pp > 1; collective)."""
        if self.mesh.pp == 1:
            return []
        mine = np.array(window.stage_figures(), dtype=np.float64)
        everyone = np.zeros((self.mesh.size, mine.size), dtype=np.float64) if self.rank0 else None
        self.mesh.world.Gather(mine, everyone, root=0)
        if not self.rank0:
            return []
        # world rank of (stage s, dp 0, tp 0) is s · dp · tp
        return [dict(stage=s, busy_s=row[0], wait_s=row[1], step_s=row[2], bubble=row[3],
                     peak_micro_batches=int(row[4]), peak_activation_bytes=int(row[5]))
                for s, row in enumerate(everyone[:: self.mesh.dp * self.mesh.tp])]

    def _log_eval(self, metrics):
        ev = self.evaluate()
        metrics.write(dict(step=self.step, **ev))
        self.log(f"eval step {self.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in ev.items()))
        return ev

    def close(self):
        """Commit a checkpoint still being written in the background (``save_checkpoint(background=True)`` with no
        ``run()`` after it; collective), stop the gradient sync's thread, close the data file, free the mesh if the
        Trainer made it (collective then), and release the lock on ``checkpoint.dir``. After ``run()`` raised on
        this rank alone, nothing collective: the save in flight is abandoned and the mesh left to the abort.
        A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._restore_signals()
            try:
                if self._failed_alone:
                    self.saver.abandon()
                else:
                    self.saver.finish()  # nothing when no save is in flight (run() commits its own before returning)
            finally:  # a save that failed is reported after everything below is released
                self.sync.close()
                if self.state.gather is not None and not self._failed_alone:
                    self.state.gather.close()  # collective: its communicator is freed
                if not self._failed_alone:
                    self._free_grad_memory()
                self.data.close()
                if self._p2p is not None:
                    self._p2p.free()
                if self.diag is not None:
                    self.diag.close()
                if self._own_mesh and not self._failed_alone:
                    self.mesh.free()
        finally:
            self._release_lock()

    def _free_grad_memory(self) -> None:
        """zero = 2 on a GPU: the gradients' device memory and addresses go back now, not at the process's exit (a
        script may build Trainer after Trainer), once nothing queued on the stream touches them."""
        state = getattr(self, "state", None)
        memory = getattr(state, "grad_memory", None)
        if getattr(memory, "close", None) is not None:
            self.be.synchronize()
            memory.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise HpctrainError(f"Trainer.{what}(): this Trainer is closed (close() gave back its data file and the "
                                "lock, and the communicators of a mesh it made); build a new one to go on")

    def _restore_signals(self):
        if self._own_stop:
            self._stop.restore()

    def _release_lock(self):
        if self._lock is not None:
            self._lock.release()
            self._lock = None
