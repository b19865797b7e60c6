"""What a run says in its log: the start-up lines (layout, what each rank holds, settings that do nothing here),
the end-of-run line, and ``log_line``, rank 0's default sink. The Trainer (train/loop.py) and the AsyncTrainer
(train/async_ps.py) print them; none of these functions communicates.
"""

from __future__ import annotations

import os
import sys

__all__ = ["log_line", "layout_line", "start_notes", "run_summary", "finished_line"]


def layout_line(trainer) -> str:
    """The first start-up line: the mesh, the backend, the parameters and how gradients travel."""
    cfg, sync, be = trainer.cfg, trainer.sync, trainer.be
    return (f"hpctrain: {trainer.mesh.describe()}, backend {be.name}, {trainer.model.layout.size:,} parameters, "
            f"{len(sync.buckets)} gradient bucket(s), overlap "
            f"{('on, communication thread' if sync.threaded else 'on') if cfg.parallel.overlap else 'off'}"
            + (f", gradients {'straight to CUDA-aware MPI' if sync.direct else 'staged through host memory'}"
               if be.is_device else "")
            + (", as bfloat16 (parallel.reduce_dtype)" if sync.wire is not None else ""))


def start_notes(trainer, zero_reduce: str, timed) -> list[str]:
    """The start-up lines after the layout's: settings that have no effect here, what ZeRO, tensor and pipeline
    parallelism give this rank. ``zero_reduce``, ``timed``: how ZeRO's buckets are summed, and the start-up
    timings behind an "auto" choice (parallel/zero.py: ``reduce_choice``)."""
    cfg, run, p = trainer.cfg, trainer.run_plan, trainer.cfg.parallel
    notes = []
    if not cfg.checkpoint.dir and cfg.train.steps > 0:
        notes.append("checkpoint.dir is empty: this run writes no checkpoint, neither at the end nor on a stop "
                     "signal (set it to keep the weights, to resume, or to sample from them)")
    if p.zero_reduce != "auto" and not p.zero:
        notes.append(f"parallel.zero_reduce = \"{p.zero_reduce}\" has no effect with parallel.zero = 0: "
                     "without ZeRO every bucket is Allreduced")
    if p.reduce_dtype != run.reduce_dtype:  # in effect over dp > 1 only
        notes.append(f"parallel.reduce_dtype = \"{p.reduce_dtype}\" has no effect with one data-parallel "
                     "rank (dp = 1): no gradient is sent")
    if p.zero != run.zero:  # in effect over dp > 1 only
        notes.append(f"parallel.zero = {p.zero} has no effect with one data-parallel rank (dp = 1): "
                     "nothing to shard the optimizer state or gradients over")
    elif trainer.zero:
        notes.append(_zero_line(trainer, zero_reduce, timed))
    if run.tp > 1:
        notes += _tensor_parallel_lines(trainer)
    if run.pp > 1:
        notes.append(_pipeline_line(trainer))
    return notes


def _zero_line(trainer, zero_reduce: str, timed) -> str:
    """What this rank updates and holds under ZeRO, and how its buckets are summed."""
    zero, shard, grad_memory = trainer.zero, trainer.shard, trainer.grad_memory
    return (f"zero {zero}: this rank updates {shard.size:,} of its part's "
            f"{trainer.part.layout.size:,} parameters (its chunk of each of {len(shard.buckets)} "
            f"bucket(s)) and holds {trainer.optim.slot_bytes / 1e6:,.1f} MB of optimizer state"
            + ("; gradients outside its chunks leave memory once reduced" + (
               f" ({grad_memory.keep_bytes / 1e6:,.1f} MB of them kept for the next backward)"
               if grad_memory.keep_bytes else "") if grad_memory
               else f"; the full gradient buffer stays ({trainer.state.keeps_grads})" if zero == 2
               else "")
            + ("; parameters outside its chunks gathered unit by unit around their use"
               if zero == 3 else "")
            + f"; buckets summed by {'Allreduce' if zero_reduce == 'allreduce' else 'Reduce_scatter'}"
            + (f" (parallel.zero_reduce = \"auto\": {timed[0] * 1e3:.1f} ms by Allreduce, "
               f"{timed[1] * 1e3:.1f} ms by Reduce_scatter on a bucket at start-up, the slowest group's)"
               if timed else ""))


def _tensor_parallel_lines(trainer) -> list[str]:
    """What tensor parallelism splits (and a warning when it splits nothing)."""
    model, part, tp = trainer.model, trainer.part, trainer.mesh.tp
    split = [f"{lo}..{hi}" for lo, hi in model.tp_pairs] if model.tp_pairs else \
        ["every transformer block"] if part.shards else []
    vocab = next((layer.vocab_rows for layer in part.layers if hasattr(layer, "vocab_rows")), None)
    rows = "" if vocab is None else \
        f"; the token table, head and loss by vocabulary (ids {vocab[0]}..{vocab[1] - 1} of {vocab[2]} here)"
    lines = [f"tensor parallel: tp {tp}, column/row-parallel pairs: {', '.join(split) or 'none'}{rows}; "
             f"this rank holds {part.owned_size:,} of {model.layout.size:,} parameters"]
    if not split:
        lines.append(f"warning: parallel.tp = {tp} splits nothing in this model (no Linear → activation "
                     "→ Linear pair): every tp rank computes the whole model; use dp instead")
    return lines


def _pipeline_line(trainer) -> str:
    """The pipeline's schedule, its stages' layers and shares of the FLOPs, and its peak live micro-batches."""
    cfg, model, mesh, s = trainer.cfg, trainer.model, trainer.mesh, trainer.runner.schedule
    total = model.flops(0, len(model.layers) - 1)
    how = "parallel.stages" if cfg.parallel.stages else "the default cut, by estimated FLOPs per row"
    v = s.virtual_stages
    names = [str(i) if v == 1 else f"{i} (stage {i % mesh.pp}, chunk {i // mesh.pp})"
             for i in range(len(trainer.stages))]
    return (f"pipeline: schedule {s.name}{f', {v} model chunks per stage' if v > 1 else ''}, "
            f"{trainer.run_plan.micro_batches} micro-batch(es), {'virtual ' if v > 1 else ''}stages ({how}) "
            + ", ".join(f"{name}: layers {lo}..{hi} ({model.flops(lo, hi) / max(total, 1):.0%} of the "
                        f"FLOPs, {model.param_count(lo, hi):,} parameters)"
                        for name, (lo, hi) in zip(names, trainer.stages))
            + f"; peak live micro-batches{' (of one chunk)' if v > 1 else ''} per stage "
            + ", ".join(map(str, trainer.runner.stats.peak_live)))


def run_summary(cfg, first_step: int, step: int, seconds: float, last: dict) -> str:
    """The end-of-run line: the steps run and their time, the last losses, where the weights are."""
    ran = step - first_step
    rate = f", {ran * cfg.train.batch_size / seconds:,.0f} samples/s overall" if ran and seconds > 0 else ""
    m, s = divmod(int(round(seconds)), 60)
    losses = "".join(f", {key} {last[key]:.4f}" for key in ("loss", "val_loss", "val_accuracy") if key in last)
    c = cfg.checkpoint
    where = (f"; checkpoint {os.path.join(c.dir, f'ckpt-{step:08d}.h5')}" if c.dir
             else "; no checkpoint (checkpoint.dir is empty)")
    end = "done" if step >= cfg.train.steps else "stopped"
    return (f"{end}: step {step} of {cfg.train.steps} ({ran:,} this run) in {m}:{s:02d}{rate}{losses}{where}")


def finished_line(cfg, step: int) -> str:
    """What a run resumed at ``step``, at or past ``train.steps``, says instead of training."""
    c, steps = cfg.checkpoint, cfg.train.steps
    where = c.dir or c.resume  # the folder, or the checkpoint named
    return (f"training already finished: {where} holds step {step}, and train.steps = {steps}; to train further, "
            f"raise train.steps past {step} (--set train.steps={step + (steps or step)}: the learning-rate schedule "
            "then differs from a run that had it from the start); to start afresh, point checkpoint.dir at a new "
            "folder")


def log_line(message: str) -> None:
    """Print one progress line and flush it: stdout to a file or pipe is block-buffered. A reader that went away
    (``hpctrain train ... | head``) does not stop training: the lines after it go nowhere."""
    try:
        print(message, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # so the interpreter's own flush at exit finds a file too
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)

