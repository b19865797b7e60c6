"""What every rank of a layout holds, in bytes: ``hpctrain plan``, and the same figures a run reports.

    hpctrain plan jobs/configs/gpt-char.toml -n 4 --set parallel.zero=1
    hpctrain plan my.toml -n 4 --mem-per-rank 5.5GB        # which ranks do not fit, and what would help
    hpctrain plan my.toml -n 8 --json

One description, ``RankMemory``, of what a rank holds: its parameters, gradients, optimizer state,
activations at the schedule's peak, communication buffers, and the runtime's own baseline. ``plan``
works it out from a config and a world size alone, without MPI and without reading the data: it
builds each stage's model part as each tensor-parallel rank would (tensor shapes only), the ZeRO
chunks of parallel/zero.py, and runs each part's forward pass on a backend that allocates and
computes nothing (``_Shapes``: arrays are zero-strided views that only know their shape), so the
activation bytes a micro-batch keeps are counted from the very arrays the layers save. On a GPU with the
step arena (``cuda.arena``) the activations are the arena's slab, planned from one micro-batch's forward and
backward requests the way the arena plans them (arena_plan.py). A training
run fills the same fields from its live buffers and its measured peaks (train/loop.py), so the two
can be compared line by line, with the process's peak RSS beside them.

The runtime baseline is measured, not derived: Python with numpy, numba's compiled kernels, h5py
and mpi4py under MPICH's mpiexec peaked at 217-224 MB on each rank training jobs/configs/digits.toml
(26 k parameters: its model state is under 1 MB) on 1 and 2 ranks; the GPT's kernels bring it to
about 235 MB (gpt-char.toml's peak less its planned state and activations, 1 and 2 ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass

import numpy as np

__all__ = ["RankMemory", "plan", "plan_table", "parse_size", "advice", "state_bytes", "checkpoint_bytes",
           "background_saves"]

RUNTIME_BYTES = {"mlp": 220_000_000, "gpt": 235_000_000}  # measured: see the module docstring


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, in bytes (``activation_bytes``: at the schedule's peak of live micro-batches)."""

    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    buffer_bytes: int
    runtime_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes
                + self.buffer_bytes + self.runtime_bytes)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


def state_bytes(*, part_size: int, owned_size: int, shard, zero: int, released: bool, slots: int,
                bucket_elems: int, micro_batches: int, gather_bytes: int = 0) -> dict:
    """Parameters, gradients and optimizer state of one rank's part (``shard``: its ZeroShard, or None) at the
    step's peak.

    zero = 2 whose gradient memory is ``released`` (host pages; on a GPU staged for MPI through host memory, where
    the device has CUDA's virtual memory management, which the plan assumes and the run's log confirms) with one
    micro-batch a rank: the gradients resident are this rank's chunks plus the buckets written but not yet
    reduced, at most two (the backward pass writes one while the communication thread scatters the other). With
    several (``micro_batches``, a rank's per step) the buckets are scattered once, after the last backward
    (accumulate, then scatter: docs/architecture.md), so the whole buffer is resident while they accumulate, as
    with zero = 1. zero = 3: the gradients as zero 2's, and the parameters this rank's chunks plus
    ``gather_bytes`` (parallel/zero3.py: the two largest units, gathered at once)."""
    owned = shard.size if shard is not None else owned_size  # a tied replica (beyond owned_size) has no slots
    grads = part_size
    if shard is not None and zero >= 2 and released and micro_batches == 1:
        grads = min(part_size, owned + 2 * bucket_elems)
    params = 4 * part_size
    if shard is not None and zero == 3:
        params = min(params, 4 * owned + gather_bytes)
    return dict(params_bytes=params, grads_bytes=4 * grads, optimizer_bytes=4 * slots * owned)


def background_saves(cfg) -> bool:
    """Whether a run keeps a snapshot for checkpoints written in the background: periodic saves before the end
    with ``checkpoint.async`` (the final and stop checkpoints are written in the foreground)."""
    c = cfg.checkpoint
    return bool(c.dir and c.async_ and 0 < c.every < cfg.train.steps)


def checkpoint_bytes(part, shard, *, dp_rank: int, slots: int, background: bool, device: bool) -> int:
    """What a rank holds beyond its state while it saves a checkpoint: the host snapshot of the pieces it writes
    (checkpoint/pieces.py: written) when saves run in the background, and on a device the host copy of its
    buffers the shard is written from. No rank gathers another's tensors."""
    from .checkpoint.pieces import written

    owned, size = part.owned_size, part.layout.size
    pieces = shard.pieces if shard else [(0, owned)] if owned < size else None
    mine = written(part, pieces, dp_rank=dp_rank, sharded_optimizer=shard is not None, slots=range(slots))
    snapshot = 4 * sum(p.size for _, p in mine) if background else 0
    slot_size = sum(b - a for a, b in pieces) if pieces else size
    return snapshot + (4 * (size + slots * slot_size) if device else 0)


def plan(cfg, world_size: int, *, device: bool = False, cuda_aware: bool = False) -> list[RankMemory]:
    """Every rank's RankMemory for ``cfg`` on ``world_size`` ranks (no MPI, no data). LayoutError or
    ConfigError when the layout does not fit the world size or the model. ``device``: on a GPU (the CUDA
    backend); ``cuda_aware``: its MPI takes device arrays (else gradients are staged through pinned host
    memory)."""
    from .nn import make_model
    from .parallel.data_parallel import make_buckets
    from .parallel.executor import micro_rows
    from .parallel.schedule import checked
    from .errors import ConfigError
    from .parallel.zero import ZeroShard, page_unit
    from .parallel.zero3 import ParamGather, refusal
    from .parallel.zero import bucket_elems as zero_bucket_elems
    from .run_plan import RunPlan

    p = cfg.parallel
    run = RunPlan.for_world(cfg, world_size)  # the layout, ZeRO in effect, deterministic's micro-batches, ...
    dp, pp, tp, zero = run.dp, run.pp, run.tp, run.zero
    model = make_model(cfg.model)
    model.check_tp(tp)
    stages = run.cut(model)  # stage s holds stages[s::pp]
    stats = checked(run.schedule, pp, run.micro_batches, run.virtual_stages)[1]
    if zero == 3 and refusal(cfg, device=device):  # parallel/zero3.py: what this version runs
        raise ConfigError(refusal(cfg, device=device))
    slots = (1 if cfg.optim.momentum else 0) if cfg.optim.name == "sgd" else 2
    bucket_elems = run.bucket_elems
    bf16 = run.reduce_dtype == "bf16"  # gradient messages in bfloat16 (parallel/wire.py)
    local_rows = run.local_batch  # samples per rank per step
    runtime = RUNTIME_BYTES["gpt" if cfg.model.kind == "gpt" else "mlp"]
    out = []
    for s in range(pp):
        for r in range(tp):
            part = model.part(chunks=stages[s::pp], tp=_ShapeOnlyTP(r, tp) if tp > 1 else None,
                              split_ties=run.deterministic)
            part.recompute = run.recompute
            mb_samples = local_rows // run.micro_batches
            if device and cfg.cuda.arena:  # the step arena's slab, planned as the arena plans it (arena_plan.py)
                acts = _arena_bytes(part, model, cfg, mb_samples, stats.peak_live[s], run.micro_batches)
            else:
                acts = _activation_bytes(part, model, mb_samples, stats.peak_live[s], device,
                                         bf16=run.precision == "bf16")
            rows = micro_rows(local_rows, run.micro_batches) * model.positions  # one micro-batch a ring slot
            rings = _ring_bytes(part, stats, s, rows) if pp > 1 else 0
            for d in range(dp):
                # zero 2 gives gradient memory back, except on a device whose MPI reads device memory itself
                released = zero >= 2 and not (device and cuda_aware)  # (train/startup.py: _why_full_gradients)
                unit = page_unit(part.layout.size) if released else 0  # as train/startup.py cuts
                cut = zero_bucket_elems(p.bucket_mb, unit) if unit else bucket_elems
                shard = ZeroShard(make_buckets(part.layout.size, cut), dp, d, limit=part.owned_size,
                                  unit=unit) if zero else None
                state = state_bytes(part_size=part.layout.size, owned_size=part.owned_size, shard=shard, zero=zero,
                                    released=released, slots=slots, bucket_elems=max(1, int(cut)),
                                    micro_batches=run.micro_batches,
                                    gather_bytes=ParamGather.pool_bytes(part) if zero == 3 else 0)
                if run.precision == "bf16" and zero != 3:  # the products' bfloat16 copy of the parameters
                    state["params_bytes"] += 2 * part.layout.size  # (backend/product_weights.py)
                # Reduce_scatter's out (zero_reduce = "auto" may take Allreduce at dp 2, without it: a bound then)
                buffers = rings + (4 * max((p[d][1] - p[d][0] for p in shard.parts), default=0)
                                   if shard and cfg.parallel.zero_reduce != "allreduce" else 0)
                if device and dp > 1 and (not cuda_aware or (run.deterministic and p.overlap) or bf16):
                    # parallel/data_parallel.py: the gradients staged through pinned host memory for MPI (or the
                    # deterministic tree's additions, which a communication thread makes on the host)
                    buffers += 4 * part.layout.size
                if bf16:  # parallel/wire.py: the buckets' bfloat16 copies, one packed buffer (on the host)
                    buffers += 2 * part.layout.size
                if run.deterministic:  # parallel/deterministic.py: the shard tree's parked sums, the tree's receive
                    buffers += 4 * part.layout.size * (run.micro_batches.bit_length() - 1) + \
                        (4 * min(part.layout.size, bucket_elems) if dp > 1 else 0)
                rank = s * dp * tp + d * tp + r  # parallel/mesh.py's order
                if cfg.checkpoint.dir:  # each rank writes its own pieces of a checkpoint
                    buffers += checkpoint_bytes(part, shard, dp_rank=d, slots=slots,
                                                background=background_saves(cfg), device=device)
                out.append(RankMemory(rank=rank, stage=s, dp_rank=d, tp_rank=r, activation_bytes=acts,
                                      buffer_bytes=buffers, runtime_bytes=runtime, **state))
    return sorted(out, key=lambda m: m.rank)


def _ring_bytes(part, stats, s: int, rows: int) -> int:
    """Stage ``s``'s receive rings (parallel/executor.py): per kind it receives, as many slots as the checker's
    peak, each as wide as the widest chunk's messages of ``rows`` rows."""
    rings = 0
    chunks = range(len(part.layer_ranges))
    if not all(part.chunk_is_first(c) for c in chunks):
        rings += (stats.peak_recv_activation[s] + 1) * rows * max(w for w, _ in part.chunk_widths) * 4
    if not all(part.chunk_is_last(c) for c in chunks):  # received gradients: one (+ 1), or what
        grads = stats.peak_recv_grad[s] if stats.peak_recv_grad else 1  # zero-bubble's W passes read
        rings += (grads + 1) * rows * max(w for _, w in part.chunk_widths) * 4
    return rings


def _activation_bytes(part, model, mb_samples: int, peak_live: int, device: bool = False, *,
                      bf16: bool = False) -> int:
    """Saved bytes of ``peak_live`` micro-batches of ``mb_samples`` samples, plus the working set of one backward:
    the unit being recomputed (recompute), the part's output with its gradient, and the largest scratch a
    layer's kernels take (attention's [B, H, T, T] arrays: ``Layer.scratch_bytes``). With model chunks
    (interleaved 1F1B) ``peak_live`` counts chunk passes, each taken at the largest chunk's bytes. ``bf16``
    (train.precision): the Linears keep their inputs in bfloat16 (``product_input``), attention its q, k, v and
    an activation after a Linear its input (``kept_output``), and on the host a product widens its operands to
    float32 copies (the largest forward product's, beside the working set)."""
    from .parallel.executor import nbytes_of
    from .params import FlatBuffer

    be = _Shapes(bf16)
    buf = FlatBuffer(be, part.layout)
    part.bind(buf, buf)
    kept = working = 0
    for c in range(len(part.layer_ranges)):
        width = part.chunk_widths[c][0]
        if part.chunk_is_first(c):
            x = be.empty((mb_samples, model.positions), np.int64) if model.positions > 1 else \
                be.empty((mb_samples, width))
        else:
            x = be.empty((mb_samples * model.positions, width))
        out, saved = part.forward(be, x, chunk=c)
        kept = max(kept, nbytes_of(saved))
        mine = 2 * int(out.nbytes)  # the output and, in backward, its gradient
        if part.recompute:  # one unit's activations are rebuilt at a time
            part.recompute = False
            _, full = part.forward(be, x, chunk=c)
            part.recompute = True
            mine += max(nbytes_of(full[a : b + 1]) for a, b in part.chunk_units[c])
        first, last = part.chunk_layers[c]
        rows = mb_samples * model.positions
        mine += max(layer.scratch_bytes(rows, device) for layer in part.layers[first : last + 1])
        if not device:  # a host bf16 product's float32 copies (``_Shapes._widened``), beside the rest
            mine += be.transient
        working = max(working, mine)
    return peak_live * kept + working


def _arena_bytes(part, model, cfg, mb_samples: int, peak_live: int, micro_batches: int) -> int:
    """On a GPU with ``cuda.arena``: the slab the step arena plans for one micro-batch's forward, loss and backward
    (the largest chunk's: arena_plan.py), with the saved activations of each further micro-batch alive at the
    schedule's peak (``peak_live``) beside it, and on a pipeline stage what every other micro-batch sends (kept
    to the step's end: the sender thread lets go of it when MPI has it)."""
    from .arena_plan import step_slab_bytes
    from .nn.loss import make_loss

    loss = make_loss(cfg.train.loss, vocab_shard=getattr(part.layers[-1], "vocab_shard", None))
    bf16 = cfg.train.precision == "bf16"
    chunks = [step_slab_bytes(part, model, loss, mb_samples, c, bf16=bf16, gemm=cfg.cuda.gemm)
              for c in range(len(part.layer_ranges))]
    slab, _, sent = max(chunks)
    kept = max(k for _, k, _ in chunks)
    return slab + (peak_live - 1) * kept + micro_batches * sum(s for _, _, s in chunks) - sent


class _Shapes:
    """A backend that allocates and computes nothing: its arrays are zero-strided views that know their shape
    and report the bytes a real array of that shape would hold. Every kernel is a no-op."""

    name, is_device = "shapes", False

    def __init__(self, bf16: bool = False):
        self.bf16, self.transient = bf16, 0

    def product_input(self, x):  # train.precision = "bf16": a bfloat16 copy, 2 bytes a value
        return self.empty(x.shape, np.uint16) if self.bf16 else x

    kept_output = product_input  # an activation's input, a product's output

    def empty_product_input(self, shape):
        return self.empty(shape, np.uint16 if self.bf16 else np.float32)

    def product_weights(self, data, refresh):  # the held copy is a parameter's (``plan``), not an activation
        return contextlib.nullcontext()

    # train.precision = "bf16" on the CPU (backend/cpu/precision.py): a product's operands widened to float32
    # copies and its rounded product, alive together inside the call; ``transient`` the largest
    def _widened(self, *arrays) -> None:
        if self.bf16:
            self.transient = max(self.transient, 4 * sum(int(a.size) for a in arrays if a is not None))

    def matmul_nt(self, a, b, out, bias=None):
        self._widened(a, b, bias)

    def matmul_nn(self, a, b, out):
        self._widened(a, b)

    def matmul_tn(self, a, b, out, accumulate=False):
        self._widened(a, b, out)

    def empty(self, shape, dtype=np.float32):
        return np.broadcast_to(np.zeros((), dtype=dtype), tuple(shape) if isinstance(shape, (tuple, list))
                               else (shape,))

    zeros = empty

    def asarray(self, host):
        return host

    def __getattr__(self, name):  # matmul_nt, layernorm_forward, add_, ...: nothing to compute
        return lambda *args, **kwargs: None


class _ShapeOnlyTP:
    """Tensor-parallel rank ``rank`` of ``size`` for building a part's shapes: its collectives do nothing."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.bytes = rank, size, 0

    def allreduce_(self, arr) -> None:
        pass

    def allreduce_host(self, arr, op=None):
        return arr


def parse_size(text: str) -> int:
    """``"5.5GB"``, ``"40G"``, ``"512MiB"``, ``"1e9"`` -> bytes (GB = 10^9, GiB = 2^30)."""
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
             "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    s = text.strip().lower()
    i = len(s)
    while i and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    try:
        value, unit = float(s[:i]), s[i:].strip()
        if unit not in units or not 0 < value * units[unit] < 2**63:
            raise ValueError
    except ValueError:
        raise ValueError(f"{text!r} is not a memory size (say 5.5GB, 40GiB or 512MB)") from None
    return int(value * units[unit])


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f}"


def size_text(n: int) -> str:
    """A memory limit as a user reads it: MB, or bytes below one MB (``--mem-per-rank 1KB`` is not "0 MB")."""
    return f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n:,} bytes"


def plan_table(ranks: list[RankMemory], limit: int | None = None) -> str:
    """One line per rank, in MB (10^6 bytes)."""
    head = ["rank", "stage", "dp", "tp", "params", "grads", "optimizer", "activations", "buffers", "runtime",
            "total MB"]
    rows = [[str(m.rank), str(m.stage), str(m.dp_rank), str(m.tp_rank), _mb(m.params_bytes), _mb(m.grads_bytes),
             _mb(m.optimizer_bytes), _mb(m.activation_bytes), _mb(m.buffer_bytes), _mb(m.runtime_bytes),
             _mb(m.total_bytes)] + (["fits" if m.total_bytes <= limit else "DOES NOT FIT"] if limit else [])
            for m in ranks]
    if limit:
        head.append(f"within {size_text(limit)}")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows)


def advice(cfg, world_size: int, limit: int, *, device: bool = False, cuda_aware: bool = False) -> list[str]:
    """Which single change of zero / recompute / micro-batches / pp / tp (keeping the world size) makes every rank
    fit; of the micro-batch counts (each a divisor of a rank's share of the batch: the activations of one kept at a
    time, as gradient accumulation does), the smallest that fits."""
    from .backend.base import FLASH_MAX_HS
    from .errors import HpctrainError
    from .run_plan import RunPlan

    p, t = cfg.parallel, cfg.train
    tries = []
    for zero in (1, 2, 3):
        if zero > p.zero:
            tries.append((f"parallel.zero={zero}", dict(parallel=dict(zero=zero))))
    if t.recompute != "blocks":
        tries.append(("train.recompute=blocks", dict(train=dict(recompute="blocks"))))
    if cfg.model.kind == "gpt" and cfg.model.attention != "flash" and (
            not device or cfg.model.n_embd // cfg.model.n_head <= FLASH_MAX_HS):
        tries.append(("model.attention=flash", dict(model=dict(attention="flash"))))
    for key in ("pp", "tp"):
        n = getattr(p, key)
        while n * 2 <= world_size:
            n *= 2
            tries.append((f"parallel.{key}={n}", dict(parallel={key: n, "stages": ()} if key == "pp" else {key: n})))
    try:
        local = RunPlan.for_world(cfg, world_size).local_batch  # a rank's share of the batch
    except HpctrainError:
        local = 0  # the layout does not fit: no micro-batch count makes it
    m = t.micro_batches * 2
    micro = []
    while local and m <= local:
        if local % m == 0:
            micro.append((f"train.micro_batches={m}", dict(train=dict(micro_batches=m))))
        m *= 2
    for zero in (2, 3):
        if p.zero < zero and t.recompute != "blocks":
            tries.append((f"parallel.zero={zero} with train.recompute=blocks",
                          dict(parallel=dict(zero=zero), train=dict(recompute="blocks"))))
    out = []
    for label, change in tries + micro:
        if label.startswith("train.micro_batches") and any(o.startswith("--set train.micro_batches") for o in out):
            break  # the smallest count that fits is the one to take
        sections = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in change.items()}
        try:
            worst = max(m.total_bytes for m in plan(dataclasses.replace(cfg, **sections), world_size, device=device,
                                                    cuda_aware=cuda_aware))
        except HpctrainError:
            continue  # that layout does not apply to this model or world size
        if worst <= limit:
            out.append(f"--set {label.replace(' with ', ' --set ')}: largest rank {_mb(worst)} MB")
    return out


def plan_json(ranks: list[RankMemory]) -> str:
    return json.dumps({"ranks": [m.as_dict() for m in ranks]}, indent=1)
