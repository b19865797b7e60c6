"""``hpctrain eval``: a trained model's loss (and accuracy) on its validation split or on any file, on any world size.

    hpctrain eval runs/digits/ckpt-00000600.h5                      # the checkpoint's own validation split
    hpctrain eval runs/digits/ckpt-00000600.h5 --data test.h5       # every sample of another file
    mpiexec -n 4 hpctrain eval jobs/configs/gpt-char.toml           # the newest checkpoint in checkpoint.dir

TARGET is a checkpoint (its config defines the model and the data) or a config file (the weights
come from ``checkpoint.init``, else the newest checkpoint in ``checkpoint.dir``). The run is laid out
afresh as data parallelism over the ranks it is started on (``--set parallel.pp=2`` etc. choose
otherwise), trains nothing and writes nothing: no checkpoint folder is locked, read for a resume or
written, no metrics or trace file. ``--data FILE`` evaluates every sample of FILE, which must hold
the datasets the config names (``data.inputs``/``data.targets``, or ``data.tokens``); without it the
config's validation split is evaluated. Collective over COMM_WORLD.
"""

from __future__ import annotations

import os
import tomllib

from . import checkpoint as ckpt
from .errors import CheckpointError, ConfigError

__all__ = ["eval_config", "evaluate"]


def eval_config(target: str, *, data: str = "", overrides=(), ranks: int = 1):
    """(config to build the evaluating Trainer from, the weights file, what is evaluated, in words), for a run on
    ``ranks`` ranks."""
    import copy
    import dataclasses

    from .config import _parse_override, apply_overrides, parse_config

    try:
        meta = ckpt.read_meta(target)
    except CheckpointError:
        if target.endswith((".h5", ".hdf5")):
            raise
        meta = None
    if meta is not None:
        text, weights, source = meta.config_text, target, f"{target} (its config)"
        if not text:
            raise CheckpointError(f"{target} carries no config: eval needs a checkpoint (ckpt-*.h5) or a config file")
    else:
        from ._files import read_capped

        raw = read_capped(target, f"config file {target!r}", ConfigError, 1 << 24)
        text, weights, source = raw.decode("utf-8", "replace"), None, target
    base = os.path.dirname(os.path.abspath(target))
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        if weights is None and not target.endswith(".toml"):  # an export (.safetensors, .pt), a data file, ...
            raise ConfigError(f"{target} is neither an hpctrain checkpoint nor a TOML config: eval takes a "
                              "checkpoint (ckpt-*.h5) or a config file (.toml)") from None
        raise ConfigError(f"{source}: malformed TOML: {e}") from None
    given = frozenset(tuple(_parse_override(item)[:2]) for item in overrides)  # paths on the command line: cwd
    if weights is None:  # a config: its checkpoint.init, else the newest checkpoint in its checkpoint.dir
        own = apply_overrides(copy.deepcopy(tables), overrides)
        weights = _weights_of(parse_config(own, base_dir=base, source=source, cwd_keys=given), source)
    # evaluate, nothing else: a fresh data-parallel layout (the overrides may choose another), no steps, no
    # files written, no resume
    tables.setdefault("parallel", {}).update(dp="auto", pp=1, tp=1, stages=[], zero=0, mode="sync", schedule="1f1b",
                                             virtual_stages=1)
    tables.setdefault("train", {}).update(steps=0, metrics="", trace="", deterministic=False)
    apply_overrides(tables, overrides)
    tables.setdefault("checkpoint", {}).update(dir="", resume="never", lock=False, every=0, init="")  # whatever --set
    tables["parallel"]["mode"] = "sync"  # a parameter server's training overrides, repeated: evaluated alike
    if data:
        tables.setdefault("data", {})["path"] = os.path.abspath(data)
    cfg = parse_config(tables, base_dir=base, source=source, cwd_keys=given)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init=os.path.abspath(weights)))
    if data:  # a test file may hold fewer samples than a training batch: the batch only sizes the chunks here
        n = _samples(cfg)
        dp = max(1, ranks // (cfg.parallel.pp * cfg.parallel.tp))
        # one micro-batch a rank, or one per stage where the schedule goes round the stages in groups (a pipeline
        # chosen again with --set)
        micro = cfg.parallel.pp if cfg.parallel.schedule == "interleaved-1f1b" else 1
        batch = min(cfg.train.batch_size, n) // (dp * micro) * (dp * micro)
        if batch < 1:
            raise ConfigError(f"{data} holds {n} sample(s), fewer than the {dp} data-parallel ranks evaluating it"
                              + (f" times the {micro} micro-batches of its schedule" if micro > 1 else ""))
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_fraction=0.0),
                                  train=dataclasses.replace(cfg.train, batch_size=batch, micro_batches=micro))
    what = f"every sample of {data}" if data else f"the validation split of {cfg.data.path}"
    return cfg, weights, what


def _samples(cfg) -> int:
    """Samples in the data file (rows, or a GPT's windows of block_size + 1 ids); when it cannot be read, a number
    no batch exceeds, so the batch stays and the Trainer says what is wrong with the file."""
    import h5py

    from ._files import H5_ERRORS, regular_file
    from .errors import DataError

    try:
        regular_file(cfg.data.path, f"data file {cfg.data.path}", DataError)
        with h5py.File(cfg.data.path, "r", locking=False) as f:
            if cfg.model.kind == "gpt":
                tokens = f[cfg.data.tokens]
                if len(tokens.shape) != 1 or tokens.dtype.kind not in "iu" or \
                        tokens.shape[0] < cfg.model.block_size + 1:  # no token ids of one window or more
                    return 1 << 62
                return (tokens.shape[0] - 1) // cfg.model.block_size
            return int(f[cfg.data.inputs].shape[0])
    except (DataError, IndexError, *H5_ERRORS):
        return 1 << 62


def _weights_of(cfg, source: str) -> str:
    if cfg.checkpoint.init:
        return cfg.checkpoint.init
    found = ckpt.list_checkpoints(cfg.checkpoint.dir) if cfg.checkpoint.dir else []
    if not found:
        raise ConfigError(f"{source}: no weights to evaluate: set checkpoint.init, or train first (checkpoint.dir "
                          f"{cfg.checkpoint.dir or 'is not set'}{' holds no checkpoint' if cfg.checkpoint.dir else ''})")
    return found[-1][1]


def evaluate(target: str, *, data: str = "", overrides=(), log=print) -> dict:
    """Evaluate TARGET (see the module's docstring) on COMM_WORLD; the result on every rank (collective)."""
    from mpi4py import MPI

    from .parallel.agree import QuietExit, run_everywhere
    from .parallel.mesh import Mesh
    from .train import Trainer

    world = MPI.COMM_WORLD
    cfg, weights, what = run_everywhere(world, lambda: eval_config(target, data=data, overrides=overrides,
                                                                   ranks=world.size))
    p = cfg.parallel
    mesh = Mesh(dp=p.dp, pp=p.pp, tp=p.tp)
    quiet = (lambda *a, **k: None)
    trainer = Trainer(cfg, mesh=mesh, log=quiet)
    try:
        run_everywhere(world, lambda: _same_tokens(weights, trainer.data))
        if data:
            result = trainer.runner.evaluate(split="all", count=True)
        else:
            if trainer.data.n_val == 0:  # the same on every rank: rank 0 says so, all leave together
                if world.rank != 0:
                    raise QuietExit(0)
                error = ConfigError(f"{what} is empty (data.val_fraction = {cfg.data.val_fraction}): pass --data FILE")
                error.collective = True
                raise error
            result = trainer.runner.evaluate(count=True)
    finally:
        trainer.close()
    mesh.free()
    if world.rank == 0:
        acc = f", accuracy {result['val_accuracy']:.4f}" if "val_accuracy" in result else ""
        log(f"{weights}: loss {result['val_loss']:.4f}{acc} on {what} ({result['samples']:,} samples, "
            f"{world.size} rank(s))")
    return result


def _same_tokens(weights: str, data) -> None:
    """DataError when ``data`` holds token ids of another vocabulary or tokenizer than the checkpoint ``weights``
    was trained on (a weights-only file does not say: nothing to compare)."""
    from . import checkpoint as ckpt
    from .data import token_mismatch
    from .errors import CheckpointError, DataError

    if not weights or (not hasattr(data, "tokens") and not hasattr(data, "train")):
        return
    try:
        meta = ckpt.read_meta(weights)
    except CheckpointError:
        return  # weights only
    problem = token_mismatch(weights, meta, data)
    if problem:
        raise DataError(problem)
