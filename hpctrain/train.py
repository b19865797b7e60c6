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
import time

import numpy as np

from . import checkpoint as ckpt
from .backend import get_backend
from .data import Sampler, open_dataset
from .dist.agree import QuietExit, check_same_everywhere, run_everywhere
from .dist.data_parallel import GradSync
from .dist.mesh import mpi_cuda_aware
from .errors import DataError, LayoutError, NonFiniteError
from .nn import Sequential, make_loss
from .optim import clip_coefficient, lr_at, make_optimizer
from .params import FlatBuffer

__all__ = ["Trainer"]


class Trainer:
    def __init__(self, cfg, *, mesh, log=print):
        self.cfg, self.mesh = cfg, mesh
        self.rank0 = mesh.rank == 0
        self.log = log if self.rank0 else (lambda *a, **k: None)
        if mesh.pp > 1 or mesh.tp > 1:
            raise LayoutError(f"parallel.pp = {mesh.pp}, parallel.tp = {mesh.tp}: only data parallelism "
                              "(pp = tp = 1) is supported so far")
        run_everywhere(mesh.world, self._build)
        check_same_everywhere(mesh.world, "config", cfg.to_toml(), lambda theirs: _first_line_diff(cfg.to_toml(), theirs))
        check_same_everywhere(mesh.world, "parameter layout", self.model.layout.describe(),
                              self.model.layout.first_difference)
        run_everywhere(mesh.world, self._init_state)
        self.sync = GradSync(comm=mesh.dp_comm, backend=self.be, grads=self.grads, layer_ranges=self.model.grad_ranges,
                             bucket_mb=cfg.parallel.bucket_mb, overlap=cfg.parallel.overlap,
                             cuda_aware=self.cuda_aware)
        self.log(f"hpctrain: {mesh.describe()}, backend {self.be.name}, {self.model.layout.size:,} parameters, "
                 f"{len(self.sync.buckets)} gradient bucket(s), overlap {'on' if cfg.parallel.overlap else 'off'}"
                 + (f", gradients {'straight to CUDA-aware MPI' if self.cuda_aware else 'staged through host memory'}"
                    if self.be.is_device else ""))

    # ------------------------------------------------------------------ set-up

    def _build(self):
        """Everything that can fail on bad input, before any parameter exists (run on every rank)."""
        cfg, mesh = self.cfg, self.mesh
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
        ca = cfg.parallel.cuda_aware
        self.cuda_aware = bool(self.be.is_device and (mpi_cuda_aware() if ca == "auto" else ca))

    def _init_state(self):
        """Parameters from a checkpoint, a weights file or a fresh init; rank 0's are broadcast to all."""
        cfg = self.cfg
        self.params = FlatBuffer(self.be, self.model.layout)
        self.grads = FlatBuffer(self.be, self.model.layout)
        self.model.bind(self.params, self.grads)
        self.optim = make_optimizer(cfg.optim, self.be, self.params, self.grads)
        self.step = 0
        if cfg.checkpoint.init:
            weights = ckpt.load_weights(cfg.checkpoint.init, self.model.layout)
            self.log(f"initial weights from {cfg.checkpoint.init}")
        else:
            weights = self.model.init_params(cfg.train.seed)
        host = np.empty(self.model.layout.size, dtype=np.float32)
        for spec in self.model.layout:
            host[spec.offset : spec.end] = weights[spec.name].reshape(-1)
        self.mesh.world.Bcast(host, root=0)  # every rank starts from rank 0's parameters
        self.be.copy_(self.params.data, self.be.asarray(host))

    # ------------------------------------------------------------------ the loop

    def run(self):
        cfg, be, mesh = self.cfg, self.be, self.mesh
        t, B, k = cfg.train, cfg.train.batch_size, cfg.train.micro_batches
        grad_scale = self.loss.grad_scale(B, self.model.out_features)
        metrics = _Metrics(t.metrics if self.rank0 else "")
        totals = dict(compute=0.0, comm=0.0, optim=0.0, data=0.0)
        window_start, window_steps = time.perf_counter(), 0
        last = {}
        try:
            while self.step < t.steps:
                step = self.step
                lr = lr_at(cfg.optim, step, t.steps)
                timing = self._train_step(step, lr, grad_scale)
                for key in totals:
                    totals[key] += timing[key]
                window_steps += 1
                self.step += 1
                if self.step % t.log_every == 0 or self.step == t.steps:
                    now = time.perf_counter()
                    loss = self._global_mean(timing["loss_sum"], B * (self.model.out_features if self.loss.name == "mse" else 1))
                    rate = window_steps * B / max(now - window_start, 1e-9)
                    last = dict(step=self.step, loss=loss, lr=lr, samples_per_s=rate, grad_norm=timing["grad_norm"],
                                **{f"{k_}_s": v / window_steps for k_, v in totals.items()})
                    if timing["skipped"]:
                        last["skipped"] = True
                    metrics.write(last)
                    self.log(f"step {self.step:>6}/{t.steps}  loss {loss:.4f}  lr {lr:.3g}  {rate:,.0f} samples/s  "
                             f"(compute {totals['compute'] / window_steps * 1e3:.1f} ms, comm wait "
                             f"{totals['comm'] / window_steps * 1e3:.1f} ms, optim {totals['optim'] / window_steps * 1e3:.1f} ms)")
                    totals = dict.fromkeys(totals, 0.0)
                    window_start, window_steps = time.perf_counter(), 0
                if self.data.n_val and ((t.eval_every and self.step % t.eval_every == 0) or self.step == t.steps):
                    ev = self.evaluate()
                    metrics.write(dict(step=self.step, **ev))
                    last.update(ev)
                    self.log(f"eval step {self.step}: " + "  ".join(f"{k_} {v:.4f}" for k_, v in ev.items()))
        finally:
            metrics.close()
        if cfg.checkpoint.dir and self.rank0:
            path = os.path.join(cfg.checkpoint.dir, "final.h5")
            ckpt.save_weights(path, self.params.to_host_dict())
            self.log(f"final weights written to {path}")
        return last

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
        self.data.close()


class _Metrics:
    """JSONL metrics on rank 0: one object a line, flushed as written."""

    def __init__(self, path):
        self.f = None
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.f = open(path, "w")

    def write(self, record):
        if self.f:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self):
        if self.f:
            self.f.close()


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
