"""The training loop: steps, gradient sync, metrics, progress, evaluation, checkpoints.

    hpctrain train jobs/configs/digits.toml                 # one process
    mpiexec -n 2 hpctrain train jobs/configs/digits.toml    # data parallel on 2 ranks
    srun hpctrain train jobs/configs/digits.toml            # under Slurm

``Trainer(cfg, mesh=mesh)`` is collective over the mesh's world communicator:
every rank builds it and calls ``run()``. Bad input found while building
(config, data, layout) is reported once by the lowest failing rank and every
rank leaves together; see dist/agree.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time

import numpy as np

from . import checkpoint as ckpt
from .backend import get_backend
from .data import Sampler, open_dataset
from .dist.agree import QuietExit, check_same_everywhere, run_everywhere
from .dist.data_parallel import GradSync
from .dist.mesh import mpi_cuda_aware
from .errors import CheckpointError, ConfigError, DataError, LayoutError, NonFiniteError
from .nn import Sequential, make_loss
from .optim import clip_coefficient, lr_at, make_optimizer
from .params import FlatBuffer

__all__ = ["Trainer"]


class Trainer:
    """One training job over a mesh. Building it and ``run()`` are collective over ``mesh.world``.

    ``log`` receives rank 0's progress lines (other ranks log nothing).
    """

    def __init__(self, cfg, *, mesh, log=print):
        self.cfg, self.mesh = cfg, mesh
        self.rank0 = mesh.rank == 0
        self.log = log if self.rank0 else (lambda *a, **k: None)
        run_everywhere(mesh.world, self._build)
        check_same_everywhere(mesh.world, "config", cfg.to_toml(), lambda theirs: _first_line_diff(cfg.to_toml(), theirs))
        check_same_everywhere(mesh.world, "parameter layout", self.model.layout.describe(),
                              self.model.layout.first_difference)
        # the gradient sync takes a different sequence of MPI calls on a device than on the host
        check_same_everywhere(mesh.world, "backend", self.be.name,
                              lambda theirs: f"{self.be.name} here, {theirs} on rank 0 (train.backend = "
                                             f"{cfg.train.backend!r}; every rank must run the same backend)")
        run_everywhere(mesh.world, self._make_state)
        # rank 0 reads whatever file is involved; a bad file is reported before any broadcast
        start = run_everywhere(mesh.world, self._read_start if self.rank0 else lambda: (None, None))
        self._broadcast_start(*start)
        self.sync = run_everywhere(mesh.world, lambda: GradSync(  # staging buffers: a device may run out
            comm=mesh.dp_comm, backend=self.be, grads=self.grads, layer_ranges=self.model.grad_ranges,
            bucket_mb=cfg.parallel.bucket_mb, overlap=cfg.parallel.overlap, cuda_aware=self.cuda_aware))
        self.log(f"hpctrain: {mesh.describe()}, backend {self.be.name}, {self.model.layout.size:,} parameters, "
                 f"{len(self.sync.buckets)} gradient bucket(s), overlap "
                 f"{('on, communication thread' if self.sync.threaded else 'on') if cfg.parallel.overlap else 'off'}"
                 + (f", gradients {'straight to CUDA-aware MPI' if self.cuda_aware else 'staged through host memory'}"
                    if self.be.is_device else ""))

    # ------------------------------------------------------------------ set-up

    def _build(self):
        """Everything that can fail on bad input, before any parameter exists (run on every rank)."""
        cfg, mesh = self.cfg, self.mesh
        if mesh.pp > 1 or mesh.tp > 1:
            raise LayoutError(f"parallel.pp = {mesh.pp}, parallel.tp = {mesh.tp}: only data parallelism "
                              "(pp = tp = 1) is supported so far")
        self.be = get_backend(cfg.train.backend, log=self.log, device_id=_local_rank(mesh))
        self.model = Sequential(cfg.model.layers)
        self.loss = make_loss(cfg.train.loss)
        self.data = open_dataset(cfg, self.loss, self.model.in_features, self.model.out_features)
        self.sampler = Sampler(self.data.n_train, cfg.train.batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                               dp_rank=mesh.dp_rank, dp_size=mesh.dp)
        if self.sampler.local % cfg.train.micro_batches:
            raise DataError(f"train.micro_batches = {cfg.train.micro_batches} does not divide this rank's share "
                            f"of the batch ({self.sampler.local} = batch_size {cfg.train.batch_size} / dp {mesh.dp})")
        n = self.data.n_train + self.data.n_val
        problem = self.data.scan(n * mesh.rank // mesh.size, n * (mesh.rank + 1) // mesh.size)
        if problem:
            raise DataError(problem)
        if self.rank0:
            self._check_outputs()
        ca = cfg.parallel.cuda_aware
        self.cuda_aware = bool(self.be.is_device and (mpi_cuda_aware() if ca == "auto" else ca))
        if self.cuda_aware and getattr(self.be, "simulator", False):
            self.log("parallel.cuda_aware: simulated device arrays have no device pointer; staging through host memory")
            self.cuda_aware = False

    def _check_outputs(self):
        """On rank 0: the metrics file and the checkpoint folder can be written (creates nothing)."""
        cfg = self.cfg
        if cfg.train.metrics:
            _check_writable("train.metrics", cfg.train.metrics, folder=False)
            inputs = {"data.path": cfg.data.path, "checkpoint.init": cfg.checkpoint.init, "the config file": cfg.source,
                      "checkpoint.resume": cfg.checkpoint.resume if cfg.checkpoint.resume not in ("auto", "never") else ""}
            for key, path in inputs.items():
                if path and os.path.exists(path) and os.path.exists(cfg.train.metrics) \
                        and os.path.samefile(path, cfg.train.metrics):
                    raise ConfigError(f"train.metrics: {cfg.train.metrics} is {key}; the metrics would overwrite it")
        if self.cfg.checkpoint.dir:
            _check_writable("checkpoint.dir", self.cfg.checkpoint.dir, folder=True)

    def _make_state(self):
        """Parameter and gradient buffers and the optimizer with its slots (run on every rank)."""
        self.params = FlatBuffer(self.be, self.model.layout)
        self.grads = FlatBuffer(self.be, self.model.layout)
        self.model.bind(self.params, self.grads)
        self.optim = make_optimizer(self.cfg.optim, self.be, self.params, self.grads)

    def _broadcast_start(self, state, weights):
        """Rank 0's starting point (a checkpoint, a weights file or a fresh init) into every rank's buffers.

        Each buffer goes through host memory (one at a time): a broadcast, then the copy into the
        backend's buffer inside an agreement, as a device may run out of memory on one rank alone.
        """
        cfg = self.cfg
        header = np.zeros(2, dtype=np.int64)  # step, optimizer step
        if state is not None:
            header[:] = state.step, state.optim_step
            weights = state.params
            self.log(f"resuming from {state.path} at step {state.step}"
                     + (f" (checkpoint.init {cfg.checkpoint.init} ignored)" if cfg.checkpoint.init else ""))
        elif weights is not None:
            self.log(f"initial weights from {cfg.checkpoint.init}")
        elif self.rank0:
            weights = self.model.init_params(cfg.train.seed)
        self.mesh.world.Bcast(header, root=0)
        self.step, self.optim.step_count = int(header[0]), int(header[1])
        targets = [(self.params, weights)]
        targets += [(buf, state.slots[slot] if state is not None else None) for slot, buf in self.optim.slots.items()]
        for buf, arrays in targets:  # arrays None: zeros
            host = self.model.layout.pack(arrays if self.rank0 else None)
            self.mesh.world.Bcast(host, root=0)
            run_everywhere(self.mesh.world, lambda: self.be.copy_(buf.data, self.be.asarray(host)))  # noqa: B023

    def _read_start(self):
        """On rank 0: (checkpoint state or None, ``checkpoint.init`` weights or None), checked against this run."""
        c, layout = self.cfg.checkpoint, self.model.layout
        state = None
        if c.resume == "auto":
            state = ckpt.find_resume(c.dir, layout, self.log) if c.dir else None
        elif c.resume != "never":
            state = ckpt.load_checkpoint(c.resume, layout)
        elif c.dir and ckpt.list_checkpoints(c.dir):
            steps = ", ".join(str(step) for step, _ in ckpt.list_checkpoints(c.dir))
            raise CheckpointError(f"checkpoint.dir {c.dir} already holds checkpoints (steps {steps}); with "
                                  "checkpoint.resume = \"never\" this run's checkpoints would mix with them (and "
                                  "retention could delete this run's): use a new checkpoint.dir or move them away")
        if state is None:
            return None, (ckpt.load_weights(c.init, layout) if c.init else None)
        self._warn_about_resume(state)
        wanted = set(self.optim.slots)
        if state.optim_name != self.optim.name or not wanted <= set(state.slots):
            raise CheckpointError(f"{state.path}: written with optimizer {state.optim_name!r} (slots "
                                  f"{', '.join(sorted(state.slots)) or 'none'}), but optim.name is {self.optim.name!r} "
                                  f"(slots {', '.join(sorted(wanted)) or 'none'})")
        return state, None

    def _warn_about_resume(self, state):
        """Log what would make a resumed run differ from the run that wrote the checkpoint."""
        c, d = self.cfg.checkpoint, self.cfg.data
        if c.dir:
            newer = [step for step, _ in ckpt.list_checkpoints(c.dir) if step > state.step]
            if newer:
                self.log(f"warning: {c.dir} holds checkpoints newer than the one resumed (steps "
                         f"{', '.join(map(str, newer))}); retention keeps the highest steps and resume = \"auto\" "
                         "would pick them later: move them away if they belong to an abandoned run")
        saved = {k: state.rng.get(k) for k in ("data_seed", "shuffle")}
        now = {"data_seed": d.seed, "shuffle": d.shuffle}
        if any(saved[k] is not None and saved[k] != now[k] for k in now):
            self.log(f"warning: the data order changed since the checkpoint was written ({saved} then, {now} now)")

    def save_checkpoint(self) -> str:
        """Write a checkpoint of the current step on rank 0 (not collective); returns its path there."""
        if not (self.rank0 and self.cfg.checkpoint.dir):
            return ""
        cfg, mesh = self.cfg, self.mesh
        state = ckpt.CheckpointState(
            step=self.step, epoch=self.sampler.epoch_of(self.step),
            data_position=self.step % self.sampler.steps_per_epoch, config_text=cfg.to_toml(),
            layout=dict(mesh.layout), params=self.params.to_host_dict(), optim_name=self.optim.name,
            optim_step=self.optim.step_count, slots={k: v.to_host_dict() for k, v in self.optim.slots.items()},
            rng={"data_seed": cfg.data.seed, "shuffle": cfg.data.shuffle, "init_seed": cfg.train.seed})
        t0 = time.perf_counter()
        path = ckpt.save_checkpoint(cfg.checkpoint.dir, state, keep=cfg.checkpoint.keep)
        self.log(f"checkpoint {path} written in {time.perf_counter() - t0:.2f} s")
        return path

    # ------------------------------------------------------------------ the loop

    def run(self):
        """Train until ``train.steps`` (collective: every rank calls it). Returns the last metrics on rank 0.

        SIGTERM and SIGUSR1 (what Slurm sends before a time limit) stop the run at the next step
        boundary, after a checkpoint when ``checkpoint.dir`` is set.
        """
        cfg, t = self.cfg, self.cfg.train
        if self.step >= t.steps > 0:
            self.log(f"training already finished: resumed at step {self.step} of {t.steps} (to train again, set "
                     "checkpoint.resume = \"never\", a new checkpoint.dir, or more train.steps)")
            return self._log_eval(_Metrics("")) if self.data.n_val else {}
        metrics = _Metrics(t.metrics if self.rank0 else "", resume_step=self.step)
        window = _Window()
        last = {}
        stop = _StopFlag()
        saved_at = -1
        try:
            while self.step < t.steps:
                lr = lr_at(cfg.optim, self.step, t.steps)
                timing = self._train_step(self.step, lr, self.grad_scale)
                self.step += 1
                window.add(timing)
                if self.step % t.log_every == 0 or self.step == t.steps:
                    last = self._log_train(window, timing, lr, metrics)
                if self.data.n_val and ((t.eval_every and self.step % t.eval_every == 0) or self.step == t.steps):
                    last.update(self._log_eval(metrics))
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save_checkpoint()
                    saved_at = self.step
                if stop.any_rank(self.mesh.world):
                    self.log(f"signal {stop.name} received: stopping at step {self.step}")
                    break
        finally:
            stop.restore()
            metrics.close()
        if saved_at != self.step:
            self.save_checkpoint()
        return last

    @property
    def grad_scale(self):
        return self.loss.grad_scale(self.cfg.train.batch_size, self.model.out_features)

    def _log_train(self, window, timing, lr, metrics):
        B = self.cfg.train.batch_size
        per_row = self.model.out_features if self.loss.name == "mse" else 1
        loss = self._global_mean(timing["loss_sum"], B * per_row)
        means, rate = window.flush(B)
        record = dict(step=self.step, loss=loss, lr=lr, samples_per_s=rate, grad_norm=timing["grad_norm"],
                      **{f"{k}_s": v for k, v in means.items()})
        if timing["skipped"]:
            record["skipped"] = True
        metrics.write(record)
        self.log(f"step {self.step:>6}/{self.cfg.train.steps}  loss {loss:.4f}  lr {lr:.3g}  {rate:,.0f} samples/s  "
                 f"(compute {means['compute'] * 1e3:.1f} ms, comm wait {means['comm'] * 1e3:.1f} ms, "
                 f"optim {means['optim'] * 1e3:.1f} ms)")
        return record

    def _log_eval(self, metrics):
        ev = self.evaluate()
        metrics.write(dict(step=self.step, **ev))
        self.log(f"eval step {self.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in ev.items()))
        return ev

    def _train_step(self, step, lr, grad_scale):
        cfg, be = self.cfg, self.be
        k = cfg.train.micro_batches
        rows = self.sampler.local_rows(step)
        per = len(rows) // k
        t_data = t_compute = 0.0
        loss_sum = 0.0
        self.sync.start_step()
        for m in range(k):
            t0 = time.perf_counter()
            x, y = self.data.read(rows[m * per : (m + 1) * per])
            x, y = be.asarray(x), be.asarray(y)
            t1 = time.perf_counter()
            out, saved = self.model.forward(be, x)
            part, _, dout = self.loss(be, out, y, grad_scale)
            loss_sum += part
            last = m == k - 1
            self.model.backward(be, dout, saved, accumulate=m > 0, on_layer_done=self.sync.layer_done if last else None)
            t_data += t1 - t0
            t_compute += time.perf_counter() - t1
        self.sync.wait()
        t0 = time.perf_counter()
        norm = math.sqrt(be.sum_squares(self.grads.data))
        skipped = not math.isfinite(norm)
        if skipped:
            if not cfg.train.skip_nonfinite:  # every rank sees the same summed gradients: all leave together
                if not self.rank0:
                    raise QuietExit(0)
                error = NonFiniteError(f"step {step + 1}: the gradients contain NaN or Inf; lower optim.lr, set "
                                       "train.grad_clip, or set train.skip_nonfinite = true to skip such steps")
                error.collective = True
                raise error
            self.log(f"step {step + 1}: non-finite gradients, step skipped")
        else:
            coef = clip_coefficient(norm, cfg.train.grad_clip)
            if coef < 1.0:
                be.scale_(self.grads.data, coef)
            self.optim.step(lr)
            be.synchronize()
        return dict(compute=t_compute, comm=self.sync.wait_seconds, optim=time.perf_counter() - t0, data=t_data,
                    loss_sum=loss_sum, grad_norm=norm, skipped=skipped)

    def _global_mean(self, local_sum, count):
        from mpi4py import MPI

        buf = np.array([local_sum], dtype=np.float64)
        self.mesh.dp_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return float(buf[0] / count)

    def evaluate(self):
        """Loss (and accuracy) over the validation split; each rank takes a contiguous share (collective)."""
        from mpi4py import MPI

        be, mesh, data = self.be, self.mesh, self.data
        lo = data.n_train + data.n_val * mesh.dp_rank // mesh.dp
        hi = data.n_train + data.n_val * (mesh.dp_rank + 1) // mesh.dp
        step = max(1, self.sampler.local)
        sums = np.zeros(3, dtype=np.float64)  # loss sum, correct, rows
        for start in range(lo, hi, step):
            x, y = data.read(np.arange(start, min(hi, start + step)))
            out, _ = self.model.forward(be, be.asarray(x))
            loss_sum, correct, _ = self.loss(be, out, be.asarray(y), 0.0)
            sums += (loss_sum, correct, len(x))
        mesh.dp_comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        per = self.model.out_features if self.loss.name == "mse" else 1
        result = {"val_loss": float(sums[0] / (sums[2] * per))}
        if self.loss.classification:
            result["val_accuracy"] = float(sums[1] / sums[2])
        return result

    def close(self):
        self.sync.close()
        self.data.close()


class _Metrics:
    """JSONL metrics on rank 0: one object a line, flushed as written.

    A resumed run keeps the lines up to the step it resumes from and appends after them.
    NaN and Inf (a skipped non-finite step) are written as null, so every line is valid JSON.
    """

    def __init__(self, path, resume_step=0):
        self.f = None
        if not path:
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if resume_step > 0 and os.path.exists(path):
            _truncate_after(path, resume_step)
            self.f = open(path, "a")
        else:
            self.f = open(path, "w")

    def write(self, record):
        if self.f:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            self.f.write(json.dumps(clean, allow_nan=False) + "\n")
            self.f.flush()

    def close(self):
        if self.f:
            self.f.close()


def _check_writable(key, path, *, folder):
    """ConfigError unless ``path`` (a folder or a file) exists writable, or can be created."""
    if os.path.exists(path):
        if os.path.isdir(path) != folder:
            raise ConfigError(f"{key}: {path} is {'not a folder' if folder else 'a folder'}")
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{key}: {path} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create {path}: {parent} is not a writable folder")


def _truncate_after(path, step):
    """Drop the metrics lines of steps after ``step`` (left by a run that went on past the checkpoint)."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:  # lines that are not ours stay as they are
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            record_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            record_step = 0  # not a metrics record: keep it as it is
        if not isinstance(record_step, int) or record_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.writelines(kept)
        os.replace(tmp, path)


class _Window:
    """Per-step time split and throughput since the last training log line."""

    KEYS = ("compute", "comm", "optim", "data")

    def __init__(self):
        self.totals, self.steps, self.start = dict.fromkeys(self.KEYS, 0.0), 0, time.perf_counter()

    def add(self, timing):
        for k in self.KEYS:
            self.totals[k] += timing[k]
        self.steps += 1

    def flush(self, batch_size):
        now = time.perf_counter()
        n = max(self.steps, 1)
        means = {k: v / n for k, v in self.totals.items()}
        rate = self.steps * batch_size / max(now - self.start, 1e-9)
        self.totals, self.steps, self.start = dict.fromkeys(self.KEYS, 0.0), 0, now
        return means, rate


class _StopFlag:
    """SIGTERM/SIGUSR1 set a flag; ranks agree on it at each step boundary (a one-int Allreduce)."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.name, self._old = "", {}
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.name = signal.Signals(signum).name

    def any_rank(self, comm) -> bool:
        from mpi4py import MPI

        flag = np.array([1 if self.name else 0], dtype=np.int32)
        if comm.Get_size() > 1:
            comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
        if flag[0] and not self.name:
            self.name = "from another rank"
        return bool(flag[0])

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _first_line_diff(mine: str, theirs: str) -> str:
    for a, b in zip(mine.splitlines(), theirs.splitlines()):
        if a != b:
            return f"{a!r} here, {b!r} on rank 0"
    return "different length"


def _local_rank(mesh) -> int:
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMI_LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0
