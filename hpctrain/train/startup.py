"""Start-up: everything that can fail on bad input, the state buffers, and where the run starts from.

Every function here runs on every rank inside an agreement (``run_everywhere``), so a
failure on one rank ends the job on all of them before any training message:

* ``build``: backend, model spec and this stage's part, loss, data, sampler, outputs, returned as one
  ``RankParts``;
* ``lock_checkpoint_dir`` (world rank 0 only): the lock on ``checkpoint.dir``, taken before
  anything in it is read or written (one job per folder; hpctrain/checkpoint/lock.py);
* ``make_state``: the part's parameter, gradient and optimizer buffers, returned as one ``RankState``
  (the Trainer reads both through ``trainer.parts`` / ``trainer.state``);
* ``load_start``: the starting point, returned as the step to start at: each rank reads its own pieces of
  a sharded checkpoint (train/checkpointing.py, collective); a single-file checkpoint or weights file is
  read whole on world rank 0 and handed out by ``scatter_start``, one buffer at a time (parallel/sharding.py);
  it reads the run through a ``Rank`` (its config, plan, mesh, log, parts and state), made once both exist;
* ``candidates``, ``check_resume``, ``warn_about_resume`` (world rank 0): which checkpoints to try, whether
  the one found is this run's, what a resumed run should be told; the parameter server uses them too.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from .. import checkpoint as ckpt
from .. import scan_cache
from ..backend import get_backend
from ..checkpoint.lock import LOCK_NAME, FolderLock
from ..data import open_dataset
from ..sampling import Sampler, continue_order, make_sampler
from ..errors import CheckpointError, ConfigError, DataError, LayoutError
from ..nn import make_loss, make_model
from ..optim import make_optimizer
from ..parallel.agree import bcast_text, run_everywhere
from ..parallel.mesh import mpi_cuda_aware
from ..parallel.sharding import scatter_flat, stage_ranges
from ..parallel.slurm import node_local
from ..parallel.tensor import TensorParallel
from ..parallel.tied import broadcast_tied
from ..parallel.transport import Transport
from ..parallel.data_parallel import make_buckets
from ..parallel.grad_pages import ReleasableHost
from ..parallel import zero3
from ..parallel.zero import ZeroShard, bucket_elems, page_unit
from ..params import FlatBuffer
from .resume_check import changed_settings, resume_problem

__all__ = ["RankParts", "RankState", "Rank", "PART_FIELDS", "STATE_FIELDS", "holder_property", "prepare_data",
           "build", "scan_data", "scan_share", "lock_checkpoint_dir", "make_state", "load_start", "candidates", "check_resume", "order_offset", "warn_about_resume", "scatter_start"]


def prepare_data(cfg, log) -> None:
    """On world rank 0, before ``build``: write a bundled corpus (``data.corpus``) to ``data.path`` if missing."""
    d = cfg.data
    if d.corpus and not os.path.exists(d.path):
        from ..text import write_corpus

        tok = write_corpus(d.corpus, d.path)
        log(f"data.corpus {d.corpus!r}: wrote {d.path} ({len(tok)} characters in the vocabulary)")


@dataclass
class RankParts:
    """What one rank runs, as start-up (``build``) makes it: read here to see what a rank holds.

    ``be`` the backend; ``cuda_aware`` whether MPI takes device arrays (else ``transport`` stages them through
    host memory); ``model`` the whole model's spec and ``stages`` its layer ranges per virtual pipeline stage (stage s runs
    ``stages[s::pp]``: one range, or interleaved 1F1B's model chunks); ``tensor``
    the tensor-parallel group (None when tp = 1); ``part`` this rank's layers and local layout (its shards under
    tp); ``loss`` (vocab-parallel under tp for the GPT); ``data`` the open data file and ``sampler`` this rank's
    rows of each step."""

    be: object
    cuda_aware: bool
    transport: Transport
    model: object
    stages: list
    tensor: TensorParallel | None
    part: object
    loss: object
    data: object
    sampler: Sampler


@dataclass
class RankState:
    """The buffers one rank trains (``make_state``): ``params`` and ``grads`` (FlatBuffers of the part's layout),
    ``optim`` with its slots for the ranges this rank updates; ``zero`` the ZeRO stage in effect (0 with one
    data-parallel rank) and ``shard`` its chunks (parallel/zero.py; None without ZeRO); ``grad_memory`` the
    releasable gradient memory of zero = 2 (ReleasableHost, or a GPU's ReleasableDevice; else None)."""

    zero: int
    shard: ZeroShard | None
    grad_memory: object | None  # ReleasableHost or backend/cuda/vmm.py's ReleasableDevice
    params: FlatBuffer
    grads: FlatBuffer
    optim: object
    keeps_grads: str = ""  # zero = 2: why the whole gradient buffer stays ("" where it gives memory back)
    gather: object | None = None  # zero = 3: parallel/zero3.py's ParamGather (the parameters' gathers)


PART_FIELDS = ("be", "cuda_aware", "transport", "model", "stages", "tensor", "part", "loss", "data", "sampler")
STATE_FIELDS = ("zero", "shard", "grad_memory", "params", "grads", "optim")


def holder_property(holder: str, name: str) -> property:
    """``x.<name>``, read from ``x.<holder>`` (``parts``: a RankParts, or ``state``: a RankState)."""
    return property(lambda self: getattr(getattr(self, holder), name),
                    doc=f"``self.{holder}.{name}`` (train/startup.py: RankParts, RankState)")


@dataclass(frozen=True)
class Rank:
    """One rank of the run as start-up's later steps read it (``load_start``, train/checkpointing.py's
    ``resume`` and ``Checkpointer``): the config, its RunPlan, the mesh, the log, what the rank runs
    (``parts``) and holds (``state``), their fields readable here by name (``rank.optim``, ``rank.part``)."""

    cfg: object
    run: object
    mesh: object
    log: object
    parts: RankParts
    state: RankState

    be, cuda_aware, transport, model, stages, tensor, part, loss, data, sampler = (
        holder_property("parts", name) for name in PART_FIELDS)
    zero, shard, grad_memory, params, grads, optim = (holder_property("state", name) for name in STATE_FIELDS)


def build(cfg, run, mesh, log) -> RankParts:
    """This rank's parts for ``cfg`` on ``mesh``, shaped by ``run`` (its RunPlan: hpctrain/run_plan.py; run on
    every rank, inside an agreement)."""
    for key in ("dp", "pp", "tp"):
        want = getattr(cfg.parallel, key)
        if want != "auto" and getattr(mesh, key) != want:
            raise LayoutError(f"the mesh has {key} = {getattr(mesh, key)} but parallel.{key} = {want}: build it with "
                              "Mesh(dp=cfg.parallel.dp, pp=cfg.parallel.pp, tp=cfg.parallel.tp)")
    be = get_backend(cfg.train.backend, log=log, device_id=node_local(mesh.world)[0], precision=run.precision,
                     arena=cfg.cuda.arena, graphs=cfg.cuda.graphs, gemm=cfg.cuda.gemm)
    ca = cfg.parallel.cuda_aware
    cuda_aware = bool(be.is_device and (mpi_cuda_aware() if ca == "auto" else ca))
    if cuda_aware and getattr(be, "simulator", False):
        log("parallel.cuda_aware: simulated device arrays have no device pointer; staging through host memory")
        cuda_aware = False
    transport = Transport(be, cuda_aware=cuda_aware)
    model = make_model(cfg.model)
    model.check_tp(mesh.tp)
    # the virtual stages' layer ranges: stage s runs stages[s::pp] (one each unless interleaved 1F1B's chunks)
    stages = run.cut(model)
    tensor = TensorParallel(mesh.tp_comm, transport) if mesh.tp > 1 else None
    # train.deterministic: a tied tensor's two halves summed apart on one stage too (parallel/deterministic.py)
    part = model.part(chunks=stages[mesh.pp_rank :: mesh.pp], tp=tensor, split_ties=run.deterministic)
    if run.deterministic and not be.is_device:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)  # OpenBLAS's GEMM bits change with its thread count
    part.recompute = run.recompute
    loss = make_loss(cfg.train.loss, vocab_shard=getattr(part.layers[-1], "vocab_shard", None))
    data = open_dataset(cfg, loss, model)
    try:
        sampler = make_sampler(cfg, data, dp_rank=mesh.dp_rank, dp_size=mesh.dp)
        if run.local_batch % run.micro_batches:
            raise DataError(f"train.micro_batches = {run.micro_batches} does not divide this rank's share "
                            f"of the batch ({run.local_batch} = batch_size {run.batch_size} / dp {run.dp})")
        if cfg.data.val_fraction > 0 and data.n_val == 0:
            log(f"warning: data.val_fraction = {cfg.data.val_fraction} of {data.n_train} samples rounds down to "
                "none: this run is never evaluated")
        if mesh.rank == 0:
            check_outputs(cfg)
    except BaseException:
        data.close()
        raise
    return RankParts(be=be, cuda_aware=cuda_aware, transport=transport, model=model, stages=stages, tensor=tensor,
                     part=part, loss=loss, data=data, sampler=sampler)


def scan_data(mesh, data, log) -> None:
    """Collective: every value of the data file checked once, each rank scanning its share (``data.scan``), unless
    world rank 0 finds a record that this file, unchanged, passed these checks before (scan_cache.py); after a
    clean scan rank 0 writes that record. A problem on any rank is one DataError on every rank."""
    key = scan_cache.scan_key(data.path, data.scan_checks) if mesh.rank == 0 and data.scan_checks else None
    if bcast_text(mesh.world, "clean" if key and scan_cache.is_clean(key) else "", 0) == "clean":
        log(f"data: {data.path} is unchanged since a clean start-up scan; not scanned again")
        return
    run_everywhere(mesh.world, lambda: scan_share(mesh, data))
    if key:
        scan_cache.remember_clean(key)


def scan_share(mesh, data) -> None:
    """This rank's share of the data file's rows (or windows) checked; DataError naming the first problem."""
    n = data.n_train + data.n_val
    problem = data.scan(n * mesh.rank // mesh.size, n * (mesh.rank + 1) // mesh.size)
    if problem:
        raise DataError(problem)


def agree_gemm(be, world, log) -> None:
    """``cuda.gemm``: one GEMM provider on every rank (collective over ``world``). Under "auto" a rank without
    cuBLASLt takes the numba kernels (an explicit "cublaslt" refuses there), and then every rank does, so a
    product computes the same bits whichever rank runs it (bit-identical layouts, ``train.deterministic``)."""
    import numpy as np
    from mpi4py import MPI

    if not be.is_device or not hasattr(be, "gemm_provider"):  # the same backend on every rank (checked before)
        return
    ok = np.array([1 if be.gemm_provider == "cublaslt" else 0], dtype=np.int32)
    world.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
    if not ok[0] and be.gemm_provider == "cublaslt":
        be.use_numba("another rank has no cuBLASLt")
        log('cuda.gemm = "auto": the numba GEMM kernels on every rank, since another rank has no cuBLASLt')


def check_outputs(cfg) -> None:
    """On rank 0: the metrics file, the trace and the checkpoint folder can be written (creates nothing)."""
    outputs = {"train.metrics": (cfg.train.metrics, "metrics"), "train.trace": (cfg.train.trace, "trace")}
    inputs = {"data.path": cfg.data.path, "checkpoint.init": cfg.checkpoint.init, "the config file": cfg.source,
              "checkpoint.resume": cfg.checkpoint.resume if cfg.checkpoint.resume not in ("auto", "never") else ""}
    for out_key, (out, what) in outputs.items():
        if not out:
            continue
        _check_writable(out_key, out, folder=False)
        for key, path in inputs.items():
            if path and os.path.exists(path) and os.path.exists(out) and os.path.samefile(path, out):
                raise ConfigError(f"{out_key}: {out} is {key}; the {what} would overwrite it")
    if cfg.train.metrics and cfg.train.trace and os.path.abspath(cfg.train.metrics) == os.path.abspath(cfg.train.trace):
        raise ConfigError(f"train.trace: {cfg.train.trace} is also train.metrics")
    if cfg.checkpoint.dir:
        _check_writable("checkpoint.dir", cfg.checkpoint.dir, folder=True)
        folder = os.path.abspath(cfg.checkpoint.dir)
        for out_key, (out, what) in outputs.items():
            full = os.path.abspath(out) if out else ""
            if full == folder or (os.path.dirname(full) == folder
                                  and re.fullmatch(r"\.?ckpt-\d{8,}\.h5.*", os.path.basename(full))):
                raise ConfigError(f"{out_key}: {out} is checkpoint.dir or a checkpoint's name in it; the {what} "
                                  "would overwrite a checkpoint")
            if full == os.path.join(folder, LOCK_NAME):
                raise ConfigError(f"{out_key}: {out} is the lock file of checkpoint.dir; the {what} would overwrite it")


def lock_checkpoint_dir(cfg, log):
    """On world rank 0, before anything reads or writes ``checkpoint.dir``: its lock (a FolderLock), or None.

    Another job holding it is a CheckpointInUseError naming that job; release the lock in ``close()``.
    """
    c = cfg.checkpoint
    if not c.dir:
        return None
    if not c.lock:
        log(f"warning: checkpoint.lock = false: {c.dir} is not locked; make sure no other job uses it")
        return None
    return FolderLock.take(c.dir, log=log)


def make_state(cfg, run, mesh, parts: RankParts) -> RankState:
    """This stage's parameter and gradient buffers and the optimizer with its slots (run on every rank); ZeRO as
    ``run`` (the RunPlan) has it in effect."""
    be, part, p = parts.be, parts.part, cfg.parallel
    size, dp = part.layout.size, mesh.dp
    zero = run.zero
    owned = part.owned_size  # a tied tensor's replica beyond it is updated by its owner: no optimizer state
    # zero = 2: gradient memory outside this rank's chunks leaves once reduced (host pages; on a GPU through
    # CUDA's virtual memory management, where the device has it); buckets and chunks are then cut on 2 MiB units,
    # so released memory leaves and returns whole
    if zero == 3 and be.is_device:
        raise ConfigError(zero3.refusal(cfg, device=True))
    keeps_grads = _why_full_gradients(be, parts.cuda_aware, mesh.world) if zero == 2 else ""
    releasable = zero >= 2 and not keeps_grads
    unit = page_unit(size) if releasable else 0
    shard = ZeroShard(make_buckets(size, bucket_elems(p.bucket_mb, unit)), dp, mesh.dp_rank, limit=owned,
                      unit=unit) if zero else None
    grad_memory = gather = None
    if zero == 3:  # parameters too: this rank's chunks stay, each unit's values come and go (parallel/zero3.py)
        memory = ReleasableHost(size, outside=zero3.ParamGather.tracked(part, shard),
                                keep_bytes=zero3.ParamGather.pool_bytes(part))
        params = FlatBuffer(be, part.layout, data=memory.array)
        gather = zero3.ParamGather(part, shard, memory, mesh.dp_comm)
    else:
        params = FlatBuffer(be, part.layout)
    if releasable:
        outside, keep = shard.outside(), shard.keep_bytes()
        grad_memory = be.releasable_buffer(size, outside=outside, keep_bytes=keep) if be.is_device else \
            ReleasableHost(size, outside=outside, keep_bytes=keep)
        grads = FlatBuffer(be, part.layout, data=grad_memory.array)
    else:
        grads = FlatBuffer(be, part.layout)
    part.bind(params, grads)
    part.gather = gather
    pieces = shard.pieces if shard else [(0, owned)] if owned < size else None
    optim = make_optimizer(cfg.optim, be, params, grads, pieces=pieces)
    return RankState(zero=zero, shard=shard, grad_memory=grad_memory, params=params, grads=grads, optim=optim,
                     keeps_grads=keeps_grads, gather=gather)


def _why_full_gradients(be, cuda_aware: bool, world) -> str:
    """zero = 2: why the whole gradient buffer stays ("" where memory outside the chunks can leave), agreed by
    every rank (collective over ``world``): the buckets' cuts follow the answer, and must be the same everywhere."""
    import numpy as np
    from mpi4py import MPI

    why = ""
    if be.is_device:
        why = be.release_unsupported or (
            "parallel.cuda_aware: an MPI that reads device memory may keep its registration by address, and zero 2 "
            "maps other memory at the same addresses; staged through host memory it gives gradient memory back"
            if cuda_aware else "")
    ok = np.array([0 if why else 1], dtype=np.int32)
    world.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
    return why or ("" if ok[0] else "another rank's device cannot give gradient memory back")


def load_start(t: Rank) -> int:
    """The run's starting point into every rank's buffers (collective over the mesh): the newest checkpoint
    that verifies (``resume = "auto"``) or the one named, each rank reading its own pieces of a sharded one
    (train/checkpointing.py); else ``checkpoint.init``'s weights or a fresh init (``scatter_start``). Returns
    the step the run starts at (the optimizer's own count and the sampler's place set with the buffers)."""
    from .checkpointing import resume

    mesh = t.mesh
    # rank 0 writes the checkpoints' root attributes and compares them: the data's fingerprint, read here once
    paths, auto = run_everywhere(mesh.world, (lambda: (t.data.fingerprint(), candidates(t))[1]) if mesh.rank == 0
                                 else lambda: ([], False))
    flag = np.array([1 if auto else 0], dtype=np.int8)
    mesh.world.Bcast(flag, root=0)
    state, whole = resume(t, paths, auto=bool(flag[0]))
    vocabulary = getattr(t.data, "vocabulary", "")  # the checkpoint must belong to this run: rank 0 holds its state
    run_everywhere(mesh.world, (lambda: check_resume(t, state, bool(flag[0]), t.data.fingerprint(), vocabulary,
                                                getattr(t.data, "tokenizer", "")))
                   if mesh.rank == 0 and state is not None else lambda: None)
    if state is not None and not whole:  # every rank holds its pieces already
        step, t.optim.step_count = state.step, state.optim_step
        t.log(f"resuming from {state.path} at step {state.step}"
              + (f" (checkpoint.init {t.cfg.checkpoint.init} ignored)" if t.cfg.checkpoint.init else ""))
        if mesh.rank == 0:
            warn_about_resume(t, state)
    else:
        if state is not None and mesh.rank == 0:
            warn_about_resume(t, state)
        c = t.cfg.checkpoint
        weights = run_everywhere(mesh.world, (lambda: _init_weights(c.init, t.model.layout))
                                 if mesh.rank == 0 and state is None and c.init else lambda: None)
        step = scatter_start(t, state if whole else None, weights)
    offset = np.array([run_everywhere(mesh.world, (lambda: order_offset(t.log, t.cfg, state, t.sampler.steps_per_epoch))
                                      if mesh.rank == 0 and state is not None else lambda: 0)], dtype=np.int64)
    mesh.world.Bcast(offset, root=0)  # where the checkpoint's data order stood (rank 0 read its state)
    t.sampler.offset = int(offset[0])
    if t.state.gather is not None:  # zero = 3: what a checkpoint or weights file gave beyond the chunks leaves
        t.state.gather.release_all()
    return step


def candidates(t) -> tuple[list[str], bool]:
    """On world rank 0: the checkpoints to try, newest first, and whether falling back past a bad one is allowed."""
    c = t.cfg.checkpoint
    if c.resume == "auto":
        return ([path for _, path in reversed(ckpt.list_checkpoints(c.dir))] if c.dir else []), True
    if c.resume != "never":
        return [c.resume], False
    if c.dir and ckpt.list_checkpoints(c.dir):
        steps = ", ".join(str(step) for step, _ in ckpt.list_checkpoints(c.dir))
        raise CheckpointError(f"checkpoint.dir {c.dir} already holds checkpoints (steps {steps}); with "
                              "checkpoint.resume = \"never\" this run's checkpoints would mix with them (and "
                              "retention could delete this run's): use a new checkpoint.dir or move them away")
    return [], False


def check_resume(t, state, auto: bool, fingerprint: str, vocabulary: str, tokenizer: str = "") -> None:
    """CheckpointError when the checkpoint resumed does not belong to this run: written for another vocabulary
    (any resume: its token ids would mean other characters), or, found by ``resume = "auto"``, with other
    settings or other data (``fingerprint``: this run's data, data.fingerprint)."""
    if state.vocabulary and vocabulary and state.vocabulary != vocabulary:
        raise CheckpointError(f"{state.path} was written for the vocabulary {_chars(state.vocabulary)} and "
                              f"{t.cfg.data.path} has {_chars(vocabulary)}: its token ids would mean other "
                              "characters; train on a token file made with the checkpoint's vocabulary, or give "
                              "this run a new checkpoint.dir")
    if state.tokenizer and tokenizer and state.tokenizer != tokenizer:
        raise CheckpointError(f"{state.path} was written for the tokenizer {state.tokenizer} and "
                              f"{t.cfg.data.path} was tokenized with {tokenizer}: its token ids would mean other "
                              "tokens; train on a token file of the checkpoint's tokenizer, or give this run a new "
                              "checkpoint.dir")
    if auto:
        changed = changed_settings(state.config_text, t.cfg, data=(state.data_fingerprint, fingerprint))
        problem = resume_problem(state.path, changed, t.cfg.checkpoint.allow_changed)
        if problem:
            raise CheckpointError(problem)


def _chars(vocabulary: str) -> str:
    shown = repr(vocabulary if len(vocabulary) <= 24 else vocabulary[:21] + "...")
    return f"{shown} ({len(vocabulary)} characters)"


def _init_weights(path: str, layout) -> dict:
    """checkpoint.init's weights: an hpctrain checkpoint or weights file, or a Hugging Face GPT2LMHeadModel folder
    (model.safetensors + config.json: hpctrain/hf.py)."""
    from ..hf import is_hf_folder, read_hf

    return read_hf(path, layout) if is_hf_folder(path) else ckpt.load_weights(path, layout)


def order_offset(log, cfg, state, steps_per_epoch: int) -> int:
    """On world rank 0: the sampler offset (sampling.continue_order) that continues ``state``'s data order with this
    run's batch size and data; 0 when neither changed. A change is said in one line."""
    then = _saved_setting(state.config_text, "train", "batch_size")
    then_batch = then if isinstance(then, int) and then > 0 else cfg.train.batch_size
    batch = cfg.train.batch_size
    offset, skipped = continue_order(state.step, state.epoch, state.data_position, then_batch, batch, steps_per_epoch)
    if offset or skipped:
        epoch, k = divmod(state.step - offset, steps_per_epoch)
        log(f"resume: the checkpoint's run had taken {state.data_position * then_batch:,} samples of epoch "
            f"{state.epoch} in batches of {then_batch}; this run goes on with epoch {epoch} at step {k} of "
            f"{steps_per_epoch} in batches of {batch}"
            + (f" ({skipped:,} samples left out to start on a whole batch)" if skipped else ""))
    return offset


def _saved_setting(config_text: str, section: str, key: str):
    """One setting of a checkpoint's stored config, or None (no config, or one that does not parse)."""
    import tomllib

    try:
        return tomllib.loads(config_text or "").get(section, {}).get(key)
    except (tomllib.TOMLDecodeError, AttributeError):
        return None


def warn_about_resume(t, state) -> None:
    """Log what would make a resumed run differ from the run that wrote the checkpoint."""
    c, d = t.cfg.checkpoint, t.cfg.data
    if c.dir:
        newer = [step for step, _ in ckpt.list_checkpoints(c.dir) if step > state.step]
        if newer:
            t.log(f"warning: {c.dir} holds checkpoints newer than the one resumed (steps "
                  f"{', '.join(map(str, newer))}); retention keeps the highest steps and resume = \"auto\" "
                  "would pick them later: move them away if they belong to an abandoned run")
    saved = {k: state.rng.get(k) for k in ("data_seed", "shuffle")}
    now = {"data_seed": d.seed, "shuffle": d.shuffle}
    if any(saved[k] is not None and saved[k] != now[k] for k in now):
        t.log(f"warning: the data order changed since the checkpoint was written ({saved} then, {now} now)")


def scatter_start(t, state, weights) -> int:
    """Rank 0's starting point (a checkpoint, a weights file or a fresh init) into every stage's buffers; returns
    its step (0 but for a checkpoint).

    Collective over the mesh. A fresh start sends nothing: each rank draws its own part from the seed. A
    checkpoint or weights file goes one buffer at a time: rank 0 packs the full tensors, ``scatter_flat`` hands
    each stage its slice (on the CPU straight into the buffer; on a device through host memory, the copy
    inside an agreement, as a device may run out of memory on one rank alone). A fresh start sends no
    optimizer state: its slots are the zeros they were made with.
    """
    cfg, mesh, rank0 = t.cfg, t.mesh, t.mesh.rank == 0
    header = np.zeros(4, dtype=np.int64)  # step, optimizer step, optimizer state to send, a fresh start
    if state is not None:
        header[:] = state.step, state.optim_step, 1, 0
        weights = state.params
        t.log(f"resuming from {state.path} at step {state.step}"
              + (f" (checkpoint.init {cfg.checkpoint.init} ignored)" if cfg.checkpoint.init else ""))
    elif weights is not None:
        t.log(f"initial weights from {cfg.checkpoint.init}")
    else:
        header[3] = 1
    mesh.world.Bcast(header, root=0)
    step, t.optim.step_count = int(header[0]), int(header[1])
    if header[3]:  # a fresh start: every rank draws its own part (nn/model.py: one stream per layer), nothing sent
        def draw():
            for name, arr in t.part.init_tensors(cfg.train.seed):  # one layer's tensors at a time
                t.be.copy_(t.params[name], t.be.asarray(np.ascontiguousarray(arr, dtype=np.float32)))
                if t.state.gather is not None:  # zero = 3: only this rank's chunks of it stay
                    t.state.gather.release_all()

        run_everywhere(mesh.world, draw)
        return step
    ranges = stage_ranges(t.model, t.stages, mesh.pp)
    full = t.model.layout.pack(weights) if rank0 else None  # one full buffer at a time, on rank 0 only
    weights = None  # a fresh start's named arrays: dropped once packed
    _scatter_buffer(t, ranges, full, t.params)
    del full
    for slot, buf in t.optim.slots.items():  # a fresh start's optimizer state is the zeros it was made with
        if header[2]:
            _scatter_buffer(t, ranges, t.model.layout.pack(state.slots.get(slot)) if rank0 else None, buf)
    return step


def _scatter_buffer(t, ranges, full, buf) -> None:
    """Rank 0's ``full`` buffer (global layout) into every rank's ``buf``: its part, its tp shards, its ZeRO
    chunks (collective over the mesh)."""
    mesh = t.mesh
    # optimizer state for the pieces this rank updates only (ZeRO's chunks; no tied replica)
    sliced = buf is not t.params and buf.layout.size != t.part.layout.size
    direct = not t.be.is_device and not sliced  # host memory: straight into the buffer, no staging copy
    host = buf.data if direct else np.zeros(t.part.layout.size, dtype=np.float32)
    scatter_flat(mesh, full, ranges, t.part, out=host[: t.part.owned_size])
    broadcast_tied(mesh, t.part, host)  # a tied tensor's replica on the last stage, from the first
    if sliced:
        host = t.optim.take(host)
    # an agreement on every rank alike (whether this one copies or not: a stage without a replica scatters
    # its slots straight into place), as a device may run out of memory on one rank alone
    run_everywhere(mesh.world, (lambda: None) if direct else lambda: t.be.copy_(buf.data, t.be.asarray(host)))


def _check_writable(key, path, *, folder):
    """ConfigError unless ``path`` (a folder or a file) exists writable, or can be created."""
    full = os.path.abspath(path)
    longest = max((len(part.encode("utf-8", "surrogateescape")) for part in full.split(os.sep)), default=0)
    if longest > 255 or len(full.encode("utf-8", "surrogateescape")) >= 4096:
        raise ConfigError(f"{key}: the path is too long ({len(full):,} characters, a name of {longest}; the limits "
                          "are 4,095 and 255 bytes)")
    if os.path.exists(path):
        if os.path.isdir(path) != folder:
            raise ConfigError(f"{key}: {path} is {'not a folder' if folder else 'a folder'}")
        if not folder and not os.path.isfile(path):  # opening a FIFO to write blocks until a reader comes
            raise ConfigError(f"{key}: {path} is not a regular file (a FIFO, socket or device)")
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{key}: {path} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create {path}: {parent} is not a writable folder")


