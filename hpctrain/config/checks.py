"""The settings checked together, once every value parsed: required keys, ranges, and the combinations a run
cannot take (``check_ranges``, the first problem a ConfigError naming its setting); ``parallel.stages``'
cover of the model's layers (``check_stages``)."""

from __future__ import annotations

import math
import os

from ..errors import ConfigError
from .sections import GPT_SIZES, Config, ParallelConfig, setting_names
from .values import _param_count

SEED_KEYS = (("train", "seed"), ("data", "seed"))
GEMM_CHOICES = ("auto", "cublaslt", "numba")  # cuda.gemm (backend/cuda/gemm/: not imported here, it needs numba)


def _need(ok, key, what):
    if not ok:
        raise ConfigError(f"{key}: {what}")


def check_ranges(cfg: Config) -> None:
    """ConfigError naming the first setting out of range or in a combination that cannot run, in this order."""
    _check_model_and_data(cfg)
    _check_train(cfg)
    _check_optim_and_checkpoint(cfg)
    _check_parallel(cfg)
    _need(cfg.cuda.graphs is not True or cfg.cuda.arena, "cuda.graphs",
          "true needs cuda.arena = true: a graph replays the addresses the arena keeps the same from step to step")
    _need(cfg.cuda.gemm in GEMM_CHOICES, "cuda.gemm", f"expected one of {', '.join(map(repr, GEMM_CHOICES))}, got "
          f"{cfg.cuda.gemm!r}")


def _check_model_and_data(cfg: Config) -> None:
    t, d, m = cfg.train, cfg.data, cfg.model
    _need(d.path, "data.path", "required (an HDF5 file)")
    if m.kind == "gpt":
        _need(not m.layers, "model.layers", 'not used by kind = "gpt" (it is set by n_layer, n_head, n_embd)')
        for key in GPT_SIZES:
            _need(getattr(m, key) >= 1, f"model.{key}", f"must be >= 1, got {getattr(m, key)}")
        _need(m.n_embd % m.n_head == 0, "model.n_embd", f"{m.n_embd} is not divisible by model.n_head = {m.n_head}")
        _need(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
        _need(d.tokens, "data.tokens", 'required by kind = "gpt" (the name of a 1-D dataset of token ids)')
        _need(not d.inputs and not d.targets, "data.inputs", 'kind = "gpt" reads data.tokens, not data.inputs '
              "and data.targets")
        _need(t.loss == "cross_entropy", "train.loss", f'kind = "gpt" trains with cross_entropy, got {t.loss!r}')
        _need(not d.corpus or d.tokens == "tokens", "data.tokens", 'data.corpus writes the dataset "tokens"; '
              f"set data.tokens = \"tokens\", got {d.tokens!r}")
    else:
        _need(not d.corpus, "data.corpus", 'a bundled corpus is text for kind = "gpt"')
        _need(m.layers, "model.layers", "the model needs at least one layer")
        _need(d.inputs, "data.inputs", "required (the name of the input dataset)")
        _need(d.targets, "data.targets", "required (the name of the target dataset)")
        _need(not d.tokens, "data.tokens", 'token datasets are for kind = "gpt"; an MLP reads data.inputs and '
              "data.targets")
    _need(0.0 <= d.val_fraction < 1.0, "data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
    _need(d.sampling == "windows" or m.kind == "gpt", "data.sampling", '"random" draws token offsets: for kind = '
          '"gpt" (rows of an MLP\'s file are shuffled with data.shuffle)')
    _need(not d.val_path or os.path.normpath(d.val_path) != os.path.normpath(d.path), "data.val_path",
          f"is data.path ({d.path}): the validation split would be training data")


def _check_train(cfg: Config) -> None:
    t, p = cfg.train, cfg.parallel
    _need(t.eval_batches >= 0, "train.eval_batches", f"must be >= 0 (0 = the whole validation split), got "
          f"{t.eval_batches}")
    unknown = [k for k in cfg.checkpoint.allow_changed if k not in setting_names()]
    _need(not unknown, "checkpoint.allow_changed", f"{', '.join(map(repr, unknown))}: not a setting (names like "
          '"optim.lr", "train.batch_size")')
    for section, key in SEED_KEYS:
        seed = getattr(getattr(cfg, section), key)
        _need(seed >= 0, f"{section}.{key}", f"must be in [0, 2**63 - 1] (a numpy seed), got {seed}")
    _need(t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}")
    _need(t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}")
    _need(t.log_every >= 1, "train.log_every", f"must be >= 1, got {t.log_every}")
    _need(t.eval_every >= 0, "train.eval_every", f"must be >= 0 (0 = only at the end), got {t.eval_every}")
    _need(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0 (0 = off), got {t.grad_clip}")
    _need(t.micro_batches >= 1, "train.micro_batches", f"must be >= 1, got {t.micro_batches}")
    S = t.deterministic_shards
    _need(S >= 1 and S & (S - 1) == 0, "train.deterministic_shards", f"must be a power of two >= 1, got {S}")
    _need(not (t.deterministic and p.mode == "async_ps"), "train.deterministic",
          'not with parallel.mode = "async_ps" (its updates arrive in the order the workers finish)')
    _need(not (t.deterministic and p.reduce_dtype != "fp32"), "parallel.reduce_dtype",
          f'"{p.reduce_dtype}" is not available with train.deterministic, whose fixed tree adds in float32')
    _need(not t.deterministic or t.batch_size % S == 0, "train.deterministic_shards",
          f"must divide train.batch_size = {t.batch_size} (every shard the same shape), got {S}")
    _need(t.collective_timeout >= 0 and math.isfinite(t.collective_timeout), "train.collective_timeout",
          f"must be a number of seconds >= 0 (0 = off), got {t.collective_timeout}")
    _need(0 <= t.peak_tflops < 1e9, "train.peak_tflops",
          f"must be one rank's peak in TFLOP/s (0 = from the device, measured on a CPU), got {t.peak_tflops}")
    _need(t.max_skipped_steps >= 1, "train.max_skipped_steps", f"must be >= 1, got {t.max_skipped_steps}")


def _check_optim_and_checkpoint(cfg: Config) -> None:
    o, c, p = cfg.optim, cfg.checkpoint, cfg.parallel
    _need(o.lr >= 0, "optim.lr", f"must be >= 0, got {o.lr}")
    _need(0 <= o.momentum < 1, "optim.momentum", f"must be in [0, 1), got {o.momentum}")
    _need(not (o.nesterov and o.momentum <= 0), "optim.nesterov", "needs optim.momentum > 0 (as in torch.optim.SGD)")
    _need(all(0 <= b < 1 for b in o.betas), "optim.betas", f"each must be in [0, 1), got {list(o.betas)}")
    _need(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    _need(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _need(0.0 <= o.min_lr <= o.lr, "optim.min_lr", f"must be in [0, optim.lr = {o.lr:g}], got {o.min_lr:g}")
    _need(0 <= o.decay_min_ndim <= 8, "optim.decay_min_ndim", f"must be in [0, 8] (2: decay only matrices, as "
          f"nanoGPT does), got {o.decay_min_ndim}")
    _need(not (o.decay_min_ndim and p.mode == "async_ps"), "optim.decay_min_ndim",
          'not supported with parallel.mode = "async_ps" yet (its servers update flat ranges, not tensors)')
    _need(c.every >= 0, "checkpoint.every", f"must be >= 0 (0 = only at the end), got {c.every}")
    _need(c.keep >= 1, "checkpoint.keep", f"must be >= 1, got {c.keep}")


def _check_parallel(cfg: Config) -> None:
    t, p, m = cfg.train, cfg.parallel, cfg.model
    _need(p.dp == "auto" or p.dp >= 1, "parallel.dp", f'must be >= 1 or "auto", got {p.dp}')
    _need(p.pp >= 1, "parallel.pp", f"must be >= 1, got {p.pp}")
    _need(p.tp >= 1, "parallel.tp", f"must be >= 1, got {p.tp}")
    _need(p.virtual_stages >= 1, "parallel.virtual_stages", f"must be >= 1, got {p.virtual_stages}")
    if p.schedule == "interleaved-1f1b":
        _need(p.virtual_stages >= 2, "parallel.virtual_stages", 'schedule = "interleaved-1f1b" needs virtual_stages '
              f">= 2 (model chunks per stage), got {p.virtual_stages}")
        _need(p.pp >= 2, "parallel.schedule", f'"interleaved-1f1b" needs parallel.pp >= 2, got pp = {p.pp}')
        _need(t.micro_batches % p.pp == 0, "train.micro_batches", f"must be a multiple of parallel.pp = {p.pp} for "
              f'schedule = "interleaved-1f1b" (micro-batches go round in groups of pp), got {t.micro_batches}')
        _need(not t.deterministic, "train.deterministic", 'not with parallel.schedule = "interleaved-1f1b" yet (a '
              'micro-batch\'s gradient is written by several chunks); use "1f1b"')
    else:
        _need(p.virtual_stages == 1, "parallel.virtual_stages", f"= {p.virtual_stages} needs parallel.schedule = "
              f'"interleaved-1f1b" (schedule {p.schedule!r} runs one model chunk per stage)')
    if p.stages and m.kind == "gpt":  # units: the embedding, the blocks, the head; each holds parameters
        check_stages(p, m.n_layer + 2, lambda lo, hi: True, "the embedding 0, blocks 1..n_layer, the head")
    elif p.stages:
        layers = cfg.model.layers
        check_stages(p, len(layers),
                     lambda lo, hi: any(_param_count(l.type, dict(l.args)) for l in layers[lo : hi + 1]), "model.layers")
    _need(0 < p.bucket_mb <= 1e6, "parallel.bucket_mb", f"must be > 0 and at most 1e6 (a terabyte), got {p.bucket_mb}")
    _need(p.servers >= 1, "parallel.servers", f"must be >= 1, got {p.servers}")
    _need(p.staleness >= 0, "parallel.staleness", f"must be >= 0 (0 = synchronous), got {p.staleness}")
    _need(isinstance(p.zero, int) and not isinstance(p.zero, bool) and p.zero in (0, 1, 2, 3), "parallel.zero",
          f"must be 0, 1, 2 or 3 (0: off; 1: optimizer state sharded over dp; 2: gradients too; 3: parameters "
          f"too), got {p.zero!r}")
    if p.zero == 3:
        from ..parallel.zero3 import refusal

        _need(not refusal(cfg), "parallel.zero", refusal(cfg))
    if p.mode == "async_ps":
        _need(p.zero == 0, "parallel.zero", f'zero = {p.zero} with parallel.mode = "async_ps" is not supported (the '
              "parameter servers already hold the optimizer state in ranges); use zero = 0")
        for key in ("pp", "tp"):
            _need(getattr(p, key) == 1, f"parallel.{key}", f'mode = "async_ps" with {key} = {getattr(p, key)} is '
                  "not supported (the parameter server trains whole models on its workers)")
        _need(not t.skip_nonfinite, "train.skip_nonfinite", 'not supported with mode = "async_ps": a non-finite '
              "gradient stops the job")
        _need(p.dp == "auto", "parallel.dp", 'mode = "async_ps": the workers are every rank but the servers; leave '
              'dp = "auto"')
        for key in ("debug_collectives", "collective_timeout"):
            _need(not getattr(t, key), f"train.{key}", 'not supported with mode = "async_ps" yet (its servers and '
                  "workers talk point to point, by their own protocol)")


def check_stages(p: "ParallelConfig", n: int, has_params, what: str) -> None:
    """parallel.stages: pp (times virtual_stages: each model chunk) inclusive [first, last] ranges covering the n
    layers in order, each with parameters."""
    if len(p.stages) != p.pp * p.virtual_stages:
        each = f" x virtual_stages = {p.virtual_stages} (a range per model chunk)" if p.virtual_stages > 1 else ""
        raise ConfigError(f"parallel.stages lists {len(p.stages)} stage(s) but parallel.pp = {p.pp}{each}")
    expect = 0
    for s, (lo, hi) in enumerate(p.stages):
        where = f"parallel.stages[{s}] = [{lo}, {hi}]"
        if hi < lo:
            raise ConfigError(f"{where}: the last layer comes before the first")
        if lo < expect:
            raise ConfigError(f"{where} overlaps the stage before it (which ends at layer {expect - 1})")
        if lo > expect:
            raise ConfigError(f"{where} leaves out layer(s) {expect}..{lo - 1}: stages must cover the layers "
                              f"0..{n - 1} ({what}) in order")
        if hi >= n:
            raise ConfigError(f"{where}: the model has layers 0..{n - 1} ({what})")
        if not has_params(lo, hi):
            raise ConfigError(f"{where} holds no parameters (only activations): give every stage a linear or "
                              "layernorm layer")
        expect = hi + 1
    if expect != n:
        raise ConfigError(f"parallel.stages end at layer {expect - 1} but the model has layers 0..{n - 1}")

