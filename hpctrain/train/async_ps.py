"""Training with ``[parallel] mode = "async_ps"``: servers hold the parameters, workers push gradients.

    mpiexec -n 3 hpctrain train jobs/configs/digits-ps.toml       # 1 server, 2 workers

The protocol is in parallel/param_server.py. Here: start-up (the same checks and data as
a synchronous run; world rank 0, the first server, locks ``checkpoint.dir`` for the run
(hpctrain/checkpoint/lock.py); each server reads its range of a sharded checkpoint, else
world rank 0 reads the starting point and the servers scatter it by range), the workers' loop (the one-stage schedule of the stage
executor, then a push), the servers' updates (the optimizer on their range: with
staleness 0 the summed gradient of the step, clipped by the global norm; with staleness
k > 0 each worker's gradient, which its worker scaled as the mean over its own share of
the batch and clipped), and the end: a sharded checkpoint in which each server writes its
range (any layout, async or sync, resumes it), the final parameters broadcast range by range
and evaluated by the workers, and world rank 0's metrics.

Collective over ``COMM_WORLD`` (a duplicate of it): every rank builds an ``AsyncTrainer`` and
calls ``run()``, then ``close()``.
"""

from __future__ import annotations

import contextlib
import math
import time
from types import SimpleNamespace

import numpy as np

from .. import checkpoint as ckpt
from .._memory import keep_freed_memory
from ..backend.cpu import CpuBackend
from ..data import file_fingerprint
from ..errors import BackendError, HpctrainError, LayoutError, NonFiniteError
from ..nn import make_model
from ..optim import clip_coefficient, lr_at, make_optimizer
from ..parallel.agree import QuietExit, bcast_text, run_everywhere
from ..parallel.executor import StageExecutor
from ..parallel.mesh import Mesh
from ..parallel.param_server import SNAPSHOTS, Server, WorkerLink, server_ranges
from ..parallel.schedule import check_schedule, data_parallel, forward_only
from ..params import FlatBuffer, ParamLayout
from ..run_plan import RunPlan
from . import startup
from .report import finished_line, log_line
from .metrics import MetricsFile
from .progress import Progress, status_line_wanted
from .step import _Batch
from .stop import StopFlag

__all__ = ["AsyncTrainer"]


class AsyncTrainer:
    """One parameter-server job over ``COMM_WORLD``; world ranks below ``parallel.servers`` serve."""

    def __init__(self, cfg, *, log=None, stop=None):
        from mpi4py import MPI

        # SIGTERM/SIGUSR1: recorded, then every rank stops at a consistent point (train/stop.py); ``stop``: a
        # StopFlag the command line installed at entry, else one of this trainer's, restored by close()
        self._own_stop = stop is None
        self._stop = StopFlag() if stop is None else stop
        self._saved_step = -1  # the step of the last checkpoint the servers wrote between updates
        keep_freed_memory()
        self.cfg, p = cfg, cfg.parallel
        self.world = MPI.COMM_WORLD.Dup()
        rank, size = self.world.Get_rank(), self.world.Get_size()
        self.rank0 = rank == 0
        self.log = (log or log_line) if self.rank0 else (lambda *a, **k: None)

        def check_layout():
            if p.servers >= size:
                raise LayoutError(f"parallel.servers = {p.servers} leaves no worker in a world of {size} rank(s): "
                                  f"start at least {p.servers + 1} ranks")
            if cfg.train.batch_size % (size - p.servers):
                raise LayoutError(f"train.batch_size = {cfg.train.batch_size} is not divisible by the "
                                  f"{size - p.servers} worker(s)")

        run_everywhere(self.world, check_layout)
        self.S, self.W, self.k = p.servers, size - p.servers, p.staleness
        self.is_server = rank < self.S
        self.servers_comm = self.world.Split(0 if self.is_server else MPI.UNDEFINED, rank)
        self.workers_comm = self.world.Split(MPI.UNDEFINED if self.is_server else 0, rank)
        self.model = make_model(cfg.model)
        self.ranges = server_ranges(self.model.layout.size, self.S)
        run_everywhere(self.world, (lambda: startup.prepare_data(cfg, self.log)) if self.rank0 else lambda: None)
        self.mesh = None
        run_everywhere(self.world, self._build_server if self.is_server else self._build_worker)
        # one job per checkpoint folder: world rank 0 locks it before anything in it is read or written
        self._lock = run_everywhere(self.world, (lambda: startup.lock_checkpoint_dir(cfg, self.log)) if self.rank0
                                    else lambda: None)
        try:
            self._start()
            run_everywhere(self.world, self._make_server if self.is_server else lambda: None)
        except BaseException:
            self._release_lock()
            raise

    # ------------------------------------------------------------------ start-up

    def _build_server(self) -> None:
        lo, hi = self.ranges[self.servers_comm.Get_rank()]
        layout = ParamLayout([("range", (hi - lo,))])
        self.be = CpuBackend()  # servers update host buffers whatever the workers' backend
        with self._server_memory():
            self.params, self.grads = FlatBuffer(self.be, layout), FlatBuffer(self.be, layout)
            self.optim = make_optimizer(self.cfg.optim, self.be, self.params, self.grads)
        self.optim.warm_up()
        self.be.sum_squares(self.grads.data[:1])  # the staleness-0 clipping's kernel, compiled now too

    def _make_server(self) -> None:
        """The server loop's state and buffers, allocated before training (the step is known now)."""
        budget = max(0, self.cfg.train.steps - self.step) * self.W if self.servers_comm.Get_rank() == 0 else None
        with self._server_memory():
            self.server = Server(world=self.world, servers_comm=self.servers_comm, workers=self.W, staleness=self.k,
                                 params=self.params.data, grads=self.grads.data, optimizer=self._update,
                                 start=self.step, budget=budget, stop_flag=lambda: bool(self._stop.name))

    @contextlib.contextmanager
    def _server_memory(self):
        """A host MemoryError on a server as one line naming its share (run inside an agreement)."""
        try:
            yield
        except MemoryError:
            lo, hi = self.ranges[self.servers_comm.Get_rank()]
            slots = 2 if self.cfg.optim.name != "sgd" else 1
            buffers = 2 + slots + SNAPSHOTS + (self.k == 0)  # params, grads (the receive), slots, the copies
            # the answers send (param_server.SNAPSHOTS, whatever the number of workers), the k = 0 sum
            raise BackendError(f"parameter server {self.servers_comm.Get_rank()} is out of memory for its "
                               f"{hi - lo:,} parameters (about {buffers * (hi - lo) * 4 / 1e6:,.3g} MB with its "
                               "optimizer state and message buffers): use more servers (parallel.servers) or "
                               "a smaller model") from None

    def _build_worker(self) -> None:
        self.mesh = Mesh(comm=self.workers_comm, dp=self.W)
        run = RunPlan.for_mesh(self.cfg, self.mesh)  # the workers' shape: data parallel over W ranks
        t = startup.build(self.cfg, run, self.mesh, lambda *a: None)
        startup.scan_share(self.mesh, t.data)  # inside the world's agreement: a bad
        # value stops the servers too (no scan record here)
        self.be, self.part, self.loss, self.data, self.sampler = t.be, t.part, t.loss, t.data, t.sampler
        self.params, self.grads = FlatBuffer(self.be, self.part.layout), FlatBuffer(self.be, self.part.layout)
        self.part.bind(self.params, self.grads)
        self.schedule = data_parallel(run.micro_batches)
        self.executor = StageExecutor(backend=self.be, part=self.part, loss=self.loss, stage=0, stages=1, p2p=None,
                                      sync=None, stats=check_schedule(self.schedule),
                                      max_rows=max(1, self.sampler.local) * self.part.positions)

    def _start(self) -> None:
        """The starting point (collective over the world): a sharded checkpoint is read by the servers, each its
        own range (``resume`` with ``_load_range``: the newest that verifies, as a Trainer resumes); a single-file
        checkpoint, ``checkpoint.init``'s weights or a fresh init come from world rank 0, scattered by range."""
        from mpi4py import MPI

        from .checkpointing import resume

        c = self.cfg.checkpoint
        start = SimpleNamespace(cfg=self.cfg, model=self.model, optim=getattr(self, "optim", None), log=self.log,
                                mesh=SimpleNamespace(world=self.world, rank=self.world.Get_rank()))
        self.data_fingerprint = ""  # world rank 0 (a server, no dataset open) reads it for the checkpoints

        def first():
            self.data_fingerprint = file_fingerprint(self.cfg)
            return startup.candidates(start)

        paths, auto = run_everywhere(self.world, first if self.rank0 else lambda: ([], False))
        flag = np.array([1 if auto else 0], dtype=np.int8)
        self.world.Bcast(flag, root=0)
        state, whole = resume(start, paths, auto=bool(flag[0]),
                              load=self._load_range if self.is_server else lambda path: None, place=lambda: (-1, None))
        run_everywhere(self.world, (lambda: startup.check_resume(start, state, bool(flag[0]), self.data_fingerprint,
                                                                 self._vocabulary(), self._tokenizer()))
                       if self.rank0 and state is not None else lambda: None)  # it must be this run's checkpoint
        weights = run_everywhere(self.world, (lambda: ckpt.load_weights(c.init, self.model.layout))
                                 if self.rank0 and state is None and c.init else lambda: None)
        header = np.zeros(2, dtype=np.int64)
        if self.rank0 and state is not None:
            header[:] = state.step, state.optim_step
            self.log(f"resuming from {state.path} at step {state.step}")
            startup.warn_about_resume(start, state)
        if self.is_server and (whole or state is None):  # rank 0's full tensors, each server its range
            full = None
            if self.rank0:
                full = [self.model.layout.pack(state.params if state else weights or
                                               self.model.init_params(self.cfg.train.seed))]
                full += [self.model.layout.pack(state.slots.get(s) if state else None) for s in self.optim.slots]
            counts = [hi - lo for lo, hi in self.ranges]
            displs = [lo for lo, _ in self.ranges]
            for i, buf in enumerate([self.params] + list(self.optim.slots.values())):
                send = [full[i], counts, displs, MPI.FLOAT] if self.rank0 else None
                self.servers_comm.Scatterv(send, buf.data, root=0)
        self.world.Bcast(header, root=0)
        epoch_steps = np.array([0 if self.is_server else self.sampler.steps_per_epoch], dtype=np.int64)
        self.world.Allreduce(MPI.IN_PLACE, epoch_steps, op=MPI.MAX)
        self.steps_per_epoch = int(epoch_steps[0])
        offset = np.array([run_everywhere(self.world, (lambda: startup.order_offset(
            self.log, self.cfg, state, self.steps_per_epoch)) if self.rank0 and state is not None else lambda: 0)],
            dtype=np.int64)  # a resume with another batch size goes on where the checkpoint's data order stood
        self.world.Bcast(offset, root=0)
        self.order_offset = int(offset[0])
        if not self.is_server:
            self.sampler.offset = self.order_offset
        self.step, optim_step = int(header[0]), int(header[1])
        if state is not None or self.step:
            self._saved_step = self.step  # resumed: that checkpoint holds this step already (not written again)
        if self.is_server:
            self.optim.step_count = optim_step
        self.log(f"hpctrain: parameter server, {self.S} server(s) and {self.W} worker(s), staleness {self.k}, "
                 f"{self.model.layout.size:,} parameters")
        if not self.cfg.checkpoint.dir and self.cfg.train.steps > 0:
            self.log("checkpoint.dir is empty: this run writes no checkpoint, neither at the end nor on a stop "
                     "signal (set it to keep the weights, to resume, or to sample from them)")

    def _load_range(self, path: str):
        """This server's range of the parameters and of every optimizer slot from sharded checkpoint ``path``,
        straight into its buffers (each block read is verified); the set's root state."""
        from ..checkpoint import read as ckpt_read
        from ..checkpoint import sharded
        from .checkpointing import check_optimizer

        index = ckpt_read.open_sharded(path, self.model.layout)
        check_optimizer(self, path, index.state.optim_name, set(index.labels[1:]))
        lo, hi = self.ranges[self.servers_comm.Get_rank()]
        pieces, opened = range_pieces(self.model.layout, lo, hi), {}
        try:
            for label, buf in [("params", self.params)] + list(self.optim.slots.items()):
                if label in index.labels:  # else a slot that starts at zero (checkpointing.ZERO_START_SLOTS)
                    ckpt_read.read_set(index, label, pieces, buf.data, opened=opened)
        finally:
            sharded.close_all(opened)
        return index.state

    # ------------------------------------------------------------------ training

    def run(self) -> dict:
        """Train to ``train.steps`` on every worker (collective over the world); world rank 0 returns the metrics."""
        t = self.cfg.train
        finished = self.step >= t.steps and self.step > 0  # resumed at or past the end: nothing written
        if finished:
            self.log(finished_line(self.cfg, self.step))
        metrics = MetricsFile(t.metrics if self.rank0 and not finished else "", resume_step=self.step,
                              tensorboard=t.tensorboard if self.rank0 and not finished else "")
        try:
            if self.is_server:
                self._serve(metrics)
            else:
                self._work()
            self._stop.shield_interrupts()  # a signal or a Ctrl-C during the checkpoint is recorded, never fatal
            summary = self._finish()  # the workers' evaluation after it keeps every rank until it is written
            metrics.write(summary)
        finally:
            metrics.close()
        return summary

    def _update(self, grad, version, *, sum_norm) -> None:
        """The optimizer on this server's range with ``grad`` (``sum_norm``: staleness 0, clip by the global norm)."""
        from mpi4py import MPI

        t = self.cfg.train
        if grad is not self.grads.data:
            self.grads.data[:] = grad
        if sum_norm:  # staleness 0: the step's summed gradient, clipped by its norm over every server
            norm2 = np.array([self.be.sum_squares(self.grads.data)], dtype=np.float64)
            if self.S > 1:
                self.servers_comm.Allreduce(MPI.IN_PLACE, norm2, op=MPI.SUM)
            self._clip(math.sqrt(norm2[0]), f"update {version + 1}: the gradients", everywhere=True)
        step = self.step + (version if self.k == 0 else version // self.W)
        self.optim.step(lr_at(self.cfg.optim, min(step, t.steps - 1), t.steps))

    def _clip(self, norm: float, what: str, *, everywhere: bool = False) -> None:
        """Scale the gradient buffer to ``train.grad_clip`` by its ``norm``; NonFiniteError when not finite.

        ``everywhere``: every server sees the same norm (staleness 0): the first one reports, the others
        leave quietly (the report aborts the job)."""
        if not math.isfinite(norm):
            if everywhere and self.servers_comm.Get_rank() != 0:
                time.sleep(10.0)  # the first server reports it and aborts the job; leaving first could cut it off
                raise QuietExit(0)
            raise NonFiniteError(f"{what} contain NaN or Inf; lower optim.lr or set train.grad_clip")
        coef = clip_coefficient(norm, self.cfg.train.grad_clip)
        if coef < 1.0:
            self.be.scale_(self.grads.data, coef)

    def _serve(self, metrics) -> None:
        t = self.cfg.train
        server = self.server
        every = t.log_every * (1 if self.k == 0 else self.W)
        last = [time.perf_counter(), 0]
        # the ETA, as the synchronous trainer's lines have; where wanted, the status line between them
        progress = Progress(t.steps, self.step, live=self.rank0 and self.log is log_line
                            and status_line_wanted(t.progress))
        log = progress.wrap(self.log)

        save_every = self.cfg.checkpoint.every if self.cfg.checkpoint.dir else 0

        def on_update(version):
            step = self.step + (version if self.k == 0 else version // self.W)  # in global batches
            if save_every and (self.k == 0 or version % self.W == 0) and step % save_every == 0 \
                    and step < t.steps:  # every server at this same update (the end's checkpoint: _finish)
                began = time.perf_counter()
                self._save_between_updates(step, log)
                last[0] += time.perf_counter() - began  # updates/s counts training: the write is left out
            if not self.rank0:
                return
            progress.advance(step)
            if version % every:
                return
            now = time.perf_counter()
            rate = (version - last[1]) / max(now - last[0], 1e-9)
            last[:] = now, version
            per = self.model.out_features if t.loss == "mse" else 1
            loss = server.loss_sum / max(server.rows * per, 1)
            server.loss_sum = server.rows = 0.0
            # two figures, two units: how old an applied gradient's parameters were (updates), and how far apart
            # the workers ran (steps, what parallel.staleness bounds)
            record = dict(step=step, updates=version, loss=loss, server_updates_per_s=rate,
                          update_lag_max=max(server.staleness, default=0), steps_ahead_max=server.ahead_max)
            metrics.write(record)
            log(f"step {step:>6}/{t.steps}  loss {loss:.4f}  {rate:,.0f} updates/s  (gradients up to "
                f"{record['update_lag_max']} updates old, workers up to {server.ahead_max} steps apart of "
                f"parallel.staleness = {self.k})  ETA {progress.eta()}")
            progress.summary = f"loss {loss:.4f}  {rate:,.0f} updates/s"

        try:
            server.run(on_update)
        finally:
            progress.clear()  # what is printed next starts on a line of its own

    def _work(self) -> None:
        t = self.cfg.train
        link = WorkerLink(world=self.world, ranges=self.ranges, servers=self.S)
        host = np.empty(self.model.layout.size, dtype=np.float32)
        m = t.micro_batches
        # staleness 0: the W gradients add up to the global batch's mean; k > 0: each is a mean of its own
        grad_scale = self.loss.grad_scale(t.batch_size * self.part.positions, self.part.spec.out_features)
        if self.k > 0:
            grad_scale *= self.W
        steps, clock = 0, self.step
        link.request(clock, host, stop=bool(self._stop.name))
        while (version := link.receive()) is not None:  # None: the budget is spent, or a signal
            self.be.copy_(self.params.data, self.be.asarray(host))
            link.request(clock + 1, host, stop=bool(self._stop.name))  # answered while this step computes
            rows = self.sampler.local_rows(clock)
            per = len(rows) // m
            batch = _Batch(self.sampler.reader(self.data), [rows[i * per : (i + 1) * per] for i in range(m)],
                           self.part.positions,
                           dropout=(t.seed, clock, self.sampler.dp_rank * self.sampler.local)
                           if self.cfg.model.dropout else None)
            r = self.executor.run(self.schedule.stages[0], batch, grad_scale=grad_scale,
                                  on_optimizer_step=lambda: None)
            if self.k > 0:  # this gradient is one update: its own norm clips it
                self._clip(math.sqrt(self.be.sum_squares(self.grads.data)),
                           f"step {clock + 1}: this worker's gradients")
            grads = self.be.to_host(self.grads.data)
            link.push(clock, version, np.ascontiguousarray(grads, dtype=np.float32), r.loss_sum, r.rows)
            steps, clock = steps + 1, clock + 1
        link.done(steps)

    # ------------------------------------------------------------------ the end

    def _finish(self) -> dict:
        """Write the checkpoint (each server its range), evaluate on the workers (collective over the world)."""
        step = np.zeros(2, dtype=np.int64)  # the step, and whether the servers saved it already (every)
        if self.is_server and self.rank0:
            pushed = sum(self.server.pushes) - self.step * self.W  # gradients applied by this run
            step[0] = self.step + pushed // self.W  # in global batches
            step[1] = step[0] == self._saved_step
        self.world.Bcast(step, root=0)
        if self._stop.any_rank(self.world) and step[0] < self.cfg.train.steps:  # as the synchronous trainer says
            self.log(f"signal {self._stop.name} received: stopping at step {int(step[0])}"
                     + ("" if self.cfg.checkpoint.dir else " (no checkpoint: checkpoint.dir is empty)"))
        if self.cfg.checkpoint.dir and not step[1]:
            self._save(int(step[0]))
        result = self._evaluate(self._final_params())
        if not self.rank0:
            return {}
        s = self.server
        summary = dict(step=int(step[0]), updates=s.version, updates_per_worker=[p - self.step for p in s.pushes],
                       update_lag_max=max(s.staleness, default=0),
                       update_lag_mean=float(np.mean(s.staleness)) if s.staleness else 0.0,
                       steps_ahead_max=s.ahead_max, server_updates_per_s=s.version / max(s.elapsed, 1e-9),
                       server_snapshots_max=s.snapshots.peak,
                       worker_idle_s=[round(x, 4) for x in s.idle], **result)
        self.log("parameter server done: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in summary.items()))
        return summary

    def _final_params(self) -> np.ndarray:
        """The final parameters on every rank, for the workers' evaluation: each server broadcasts its range
        (a server keeps only a scratch of its largest range, not the model)."""
        full = np.empty(self.model.layout.size if not self.is_server else 0, dtype=np.float32)
        scratch = np.empty(max(hi - lo for lo, hi in self.ranges) if self.is_server else 0, dtype=np.float32)
        me = self.servers_comm.Get_rank() if self.is_server else -1
        for s, (lo, hi) in enumerate(self.ranges):
            buf = self.params.data if s == me else (full[lo:hi] if not self.is_server else scratch[: hi - lo])
            self.world.Bcast(buf, root=s)  # servers are world ranks 0 .. S - 1
        return full

    def _save_between_updates(self, step: int, log) -> None:
        """``checkpoint.every``: the servers alone write one, each at the same update of its own count (each
        applies every gradient a worker pushed, so each reaches it without the others; the workers wait for
        their next parameters meanwhile). A failure is the servers' agreement only, so the job is aborted:
        the workers are not in it and would wait for ever."""
        try:
            self._save(step, self.servers_comm, log)
        except HpctrainError as e:
            e.collective = False  # the CLI aborts the world for an error that is not every rank's
            raise
        self._saved_step = step

    def _save(self, step: int, comm=None, log=None) -> None:
        """A sharded checkpoint, each server writing its range of the parameters and of every optimizer slot (a
        dp layout of the workers: any layout, async or sync, resumes it); the index on world rank 0. Collective
        over ``comm``: the world (the end of the run), or the servers alone (``_save_between_updates``)."""
        from .checkpointing import save_pieces

        cfg, layout, comm = self.cfg, self.model.layout, comm or self.world
        names = bcast_text(comm, " ".join(self.optim.slots) if self.rank0 else None, 0).split()  # the
        # workers hold no optimizer: its slots' names as world rank 0 (a server) has them
        epoch, position = divmod(step - self.order_offset, self.steps_per_epoch)
        state = ckpt.CheckpointState(
            step=step, epoch=epoch, data_position=position, config_text=cfg.to_toml(),
            layout={"world_size": self.W, "dp": self.W, "pp": 1, "tp": 1},  # the workers, a dp layout
            params={}, optim_name=self.optim.name if self.is_server else cfg.optim.name,
            optim_step=self.optim.step_count if self.is_server else 0,
            slots={name: {} for name in names},
            rng={"data_seed": cfg.data.seed, "shuffle": cfg.data.shuffle, "init_seed": cfg.train.seed},
            vocabulary=self._vocabulary() if self.rank0 else "", data_fingerprint=self.data_fingerprint,
            tokenizer=self._tokenizer() if self.rank0 else "")
        items = []
        if self.is_server:
            lo, hi = self.ranges[self.servers_comm.Get_rank()]
            for label, buf in [("params", self.params)] + list(self.optim.slots.items()):
                items += [(label, p, buf.data[p.at : p.at + p.size]) for p in range_pieces(layout, lo, hi)]
        path = save_pieces(comm, state, items, directory=cfg.checkpoint.dir, layout=layout, keep=cfg.checkpoint.keep,
                           log=log or self.log)
        (log or self.log)(f"checkpoint {path} written")

    def _vocabulary(self) -> str:
        """A language model's vocabulary for its checkpoint (rank 0 serves and has no dataset open)."""
        if self.cfg.model.kind != "gpt":
            return ""
        from ..text import read_vocabulary

        tok = read_vocabulary(self.cfg.data.path, self.cfg.data.tokens)
        return tok.vocabulary if tok is not None else ""

    def _tokenizer(self) -> str:
        """A language model's subword tokenizer (hpctrain/tokens.py) for its checkpoint, as JSON; "" for none."""
        if self.cfg.model.kind != "gpt":
            return ""
        import json

        from ..tokens import read_attrs

        info = read_attrs(self.cfg.data.path, self.cfg.data.tokens)
        return json.dumps({k: info[k] for k in ("name", "sha256", "n_vocab")}, sort_keys=True) if info else ""

    def _evaluate(self, params: np.ndarray) -> dict:
        """Validation loss (and accuracy) of ``params``, each worker a share of the split (collective)."""
        from mpi4py import MPI

        sums = np.zeros(3, dtype=np.float64)
        if not self.is_server and self.data.n_val:
            self.be.copy_(self.params.data, self.be.asarray(params))
            w = self.workers_comm.Get_rank()
            n_val = self.data.n_val  # train.eval_batches: the split's first batches of batch_size samples
            if self.cfg.train.eval_batches:
                n_val = min(n_val, self.cfg.train.eval_batches * self.cfg.train.batch_size)
            lo = self.data.n_train + n_val * w // self.W
            hi = self.data.n_train + n_val * (w + 1) // self.W
            chunk = max(1, self.sampler.local)
            row_lists = [np.arange(a, min(hi, a + chunk)) for a in range(lo, hi, chunk)]
            if row_lists:
                schedule = forward_only(1, len(row_lists))
                r = self.executor.run(schedule.stages[0], _Batch(self.data, row_lists, self.part.positions))
                sums[:] = r.loss_sum, r.correct, r.rows
        self.world.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        if not sums[2]:
            return {}
        per = self.model.out_features if self.cfg.train.loss == "mse" else 1
        out = {"val_loss": float(sums[0] / (sums[2] * per))}
        if self.cfg.train.loss == "cross_entropy":
            out["val_accuracy"] = float(sums[1] / sums[2])
        return out

    def close(self) -> None:
        """Free the communicators (collective) and release the lock on ``checkpoint.dir``."""
        try:
            if self._own_stop:
                self._stop.restore()
            if not self.is_server:
                self.data.close()
                self.mesh.free()
            for comm in (self.servers_comm, self.workers_comm):
                from mpi4py import MPI

                if comm != MPI.COMM_NULL:
                    comm.Free()
            self.world.Free()
        finally:
            self._release_lock()

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def range_pieces(layout, lo: int, hi: int) -> list:
    """The pieces of range [lo, hi) of ``layout``'s flat buffer, at their places in a buffer holding the range
    (checkpoint/pieces.py): a whole tensor, or the part of one the range cuts."""
    from ..checkpoint.pieces import Piece

    return [Piece(s.name, s.shape, None, 0, 1, max(lo, s.offset) - s.offset, min(hi, s.end) - s.offset,
                  max(lo, s.offset) - lo) for s in layout if s.offset < hi and s.end > lo]
