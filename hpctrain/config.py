"""TOML config -> frozen dataclasses.

A config has the sections ``[model] [data] [train] [optim] [checkpoint]
[parallel]``; docs/config.md documents every key. Unknown sections or keys and
values of the wrong type raise ``ConfigError`` naming the key. Relative paths
in the file resolve against the folder of the config file; those given as
overrides (``--set``) against the working directory, as on any command line
(a bare file name for ``train.metrics``, ``trace`` or ``tensorboard`` lands in
``checkpoint.dir`` either way).

    cfg = load_config("jobs/configs/digits.toml", ["train.steps=100"])
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from ._files import MAX_CONFIG_BYTES, read_capped, shown
from .errors import ConfigError
from .layer_kinds import registered, registered_names

__all__ = ["Config", "LayerSpec", "load_config", "parse_config", "config_to_toml"]

LAYER_KEYS = {
    "linear": {"in": int, "out": int, "bias": bool},
    "relu": {},
    "gelu": {},
    "tanh": {},
    "layernorm": {"dim": int, "eps": float},
}
LAYER_REQUIRED = {"linear": ("in", "out"), "layernorm": ("dim",)}
INT64_MAX = 2**63 - 1  # TOML integers are 64-bit; checkpoints store steps and seeds as int64
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: below it a value is subnormal, or 0 on a GPU
# float settings the kernels read as float32: a value beyond float32's range overflows there (optim.eps = 1e308 gives
# inf, then NaN), one below its smallest normal number is flushed to 0 (optim.lr = 1e-39 trains nothing)
FLOAT32_KEYS = frozenset({"optim.lr", "optim.momentum", "optim.eps", "optim.betas", "optim.weight_decay",
                          "optim.min_lr", "train.grad_clip", "model.dropout", "eps"})


class _Literal(float):
    """A TOML float as written: ``1e-400`` reads as 0.0, and only its text tells it was not zero."""

    text = ""


def _parse_float(text: str) -> float:
    value = _Literal(text.replace("_", ""))
    value.text = text
    return value
SEED_KEYS = (("train", "seed"), ("data", "seed"))


@dataclass(frozen=True)
class LayerSpec:
    type: str
    args: tuple[tuple[str, Any], ...] = ()

    def get(self, key, default=None):
        return dict(self.args).get(key, default)

    def as_dict(self):
        return {"type": self.type, **dict(self.args)}


GPT_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "dropout", "attention")
GPT_SIZES = GPT_KEYS[:5]


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "mlp"
    layers: tuple[LayerSpec, ...] = ()
    # kind = "gpt": nanoGPT's GPTConfig names and defaults (GPT-2 small, vocabulary padded to 50304)
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True
    dropout: float = 0.0  # nanoGPT's: on the embedding, attention's probabilities and both residual branches
    # "math": attention keeps its probabilities [B, H, T, T] for the backward; "flash": each row's log-sum-exp
    # only, the probabilities recomputed in backward (no T² tensor per head is kept: long block_size)
    attention: str = "math"


@dataclass(frozen=True)
class DataConfig:
    path: str = ""
    inputs: str = ""
    targets: str = ""
    tokens: str = ""  # kind = "gpt": a 1-D dataset of token ids, cut into windows of block_size + 1
    corpus: str = ""  # "pydoc": write the bundled text corpus to data.path when the file does not exist
    val_fraction: float = 0.1
    val_path: str = ""  # a separate validation file (nanoGPT's val.bin): data.path is then all training data
    sampling: str = "windows"  # kind = "gpt": "windows" of block_size + 1 tokens, or "random" offsets (nanoGPT)
    shuffle: bool = True
    seed: int = 0
    allow_external: bool = False  # follow HDF5 external storage, virtual datasets and external links (hpctrain/_files.py)


@dataclass(frozen=True)
class TrainConfig:
    loss: str = "cross_entropy"
    batch_size: int = 64
    steps: int = 1000
    seed: int = 0
    backend: str = "auto"
    log_every: int = 50
    eval_every: int = 200
    eval_batches: int = 0  # evaluation reads this many batches of batch_size from the validation split; 0 = all
    metrics: str = ""
    grad_clip: float = 0.0
    micro_batches: int = 1
    skip_nonfinite: bool = False
    max_skipped_steps: int = 10  # skip_nonfinite: this many non-finite steps in a row stop the run
    recompute: str = "none"  # "blocks": keep each partition unit's input only, recompute its forward in backward
    trace: str = ""
    tensorboard: str = ""  # a folder: every metrics record's numbers as TensorBoard scalars (tensorboardX)
    debug_collectives: bool = False  # fingerprint every collective across its ranks (parallel/watch.py)
    collective_timeout: float = 0.0  # seconds in one MPI call (or silent) before the job is ended; 0 = off
    progress: str = "auto"  # the status line: "bar" always, "lines" never, "auto" on a terminal (train/progress.py)
    deterministic: bool = False  # the same bits for any dp and pp (parallel/deterministic.py)
    deterministic_shards: int = 4  # deterministic: the global batch's logical shards (a power of two)
    peak_tflops: float = 0.0  # one rank's peak for MFU; 0: the GPU's datasheet figure, or measured on the CPU
    precision: str = "fp32"  # the GEMMs' type: "bf16" rounds their inputs and outputs (backend/cpu/precision.py)


@dataclass(frozen=True)
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = -1.0  # unset: resolved to torch.optim's default for `name` below
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0  # where the cosine, linear and nanogpt schedules end
    decay_min_ndim: int = 0  # weight decay only on tensors of at least this many dimensions (2: nanoGPT's rule)

    def __post_init__(self):
        if self.weight_decay < 0:  # torch.optim's defaults: AdamW 0.01, SGD and Adam 0
            object.__setattr__(self, "weight_decay", 0.01 if self.name == "adamw" else 0.0)


@dataclass(frozen=True)
class CheckpointConfig:
    init: str = ""
    dir: str = ""
    every: int = 0
    keep: int = 3
    resume: str = "auto"
    lock: bool = True  # world rank 0 holds <dir>/hpctrain.lock for the run (hpctrain/checkpoint/lock.py)
    async_: bool = True  # TOML key ``async``: periodic checkpoints are written by a thread while training runs
    allow_changed: tuple[str, ...] = ()  # resume = "auto": settings that may differ from the checkpoint's run


@dataclass(frozen=True)
class ParallelConfig:
    dp: int | str = "auto"
    pp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline stage (schedule = "interleaved-1f1b")
    stages: tuple[tuple[int, int], ...] = ()
    bucket_mb: float = 25.0
    overlap: bool = True
    cuda_aware: bool | str = "auto"
    mode: str = "sync"  # "async_ps": the first `servers` ranks serve the parameters, the others work
    servers: int = 1
    staleness: int = 0  # async_ps: a worker is at most this many steps ahead of the slowest
    zero: int = 0  # ZeRO over dp: 1 shards the optimizer state, 2 also the gradients (parallel/zero.py)
    zero_reduce: str = "auto"  # ZeRO: how a bucket's gradients are summed (parallel/zero.py: reduce_choice)
    reduce_dtype: str = "fp32"  # the type gradient buckets travel in over dp: "bf16" halves them (parallel/wire.py)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    source: str = field(default="", compare=False)  # the config file it came from, for messages

    def to_toml(self) -> str:
        return config_to_toml(self)


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "parallel": ParallelConfig,
}
PATH_KEYS = {("data", "path"), ("data", "val_path"), ("train", "metrics"), ("train", "trace"), ("train", "tensorboard"),
             ("checkpoint", "init"),
             ("checkpoint", "dir")}
CHOICES = {
    ("model", "kind"): ("mlp", "gpt"),
    ("model", "attention"): ("math", "flash"),
    ("data", "corpus"): ("", "pydoc"),
    ("data", "sampling"): ("windows", "random"),
    ("train", "loss"): ("cross_entropy", "mse"),
    ("train", "recompute"): ("none", "blocks"),
    ("train", "backend"): ("auto", "cpu", "cuda"),
    ("optim", "name"): ("sgd", "adam", "adamw"),
    ("optim", "schedule"): ("constant", "cosine", "linear", "nanogpt"),
    ("parallel", "schedule"): ("1f1b", "gpipe", "zero-bubble", "zero-bubble-h2", "interleaved-1f1b"),
    ("train", "progress"): ("auto", "bar", "lines"),
    ("parallel", "mode"): ("sync", "async_ps"),
    ("parallel", "zero_reduce"): ("auto", "reduce_scatter", "allreduce"),
    ("parallel", "reduce_dtype"): ("fp32", "bf16"),
    ("train", "precision"): ("fp32", "tf32", "bf16"),
}


def _type_name(value) -> str:
    kind = float if isinstance(value, _Literal) else type(value)
    return {bool: "bool", int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(
        kind, kind.__name__
    )


def _coerce(key: str, value, annotation: str):
    """Check one scalar against the dataclass annotation; return the stored value."""
    bad = ConfigError(f"{key}: expected {annotation.replace('|', 'or')}, got {_type_name(value)} {value!r}")
    if annotation == "bool":
        if not isinstance(value, bool):
            raise bad
        return value
    if annotation == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return _int64(key, value)
    if annotation == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return _float_in_range(key, value)
    if annotation == "str":
        if not isinstance(value, str):
            raise bad
        if "\0" in value:  # no file name, schedule or backend holds one; the OS refuses them in paths
            raise ConfigError(f"{key}: must not contain a NUL character")
        return value
    if annotation == "int | str":  # parallel.dp
        if isinstance(value, str) and value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f'{key}: expected a positive integer or "auto", got {value!r}')
        return _int64(key, value)
    if annotation == "bool | str":  # parallel.cuda_aware
        if isinstance(value, bool) or value == "auto":
            return value
        raise ConfigError(f'{key}: expected true, false or "auto", got {value!r}')
    if annotation == "tuple[tuple[int, int], ...]":  # parallel.stages
        form = f"{key}: expected an array of [first, last] layer index pairs like [[0, 3], [4, 6]], got {value!r}"
        if not isinstance(value, list) or not all(isinstance(v, list) and len(v) == 2 for v in value):
            raise ConfigError(form)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for v in value for i in v):
            raise ConfigError(form + " (indices are integers >= 0)")
        return tuple((int(a), int(b)) for a, b in value)
    if annotation == "tuple[str, ...]":  # checkpoint.allow_changed
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f'{key}: expected an array of setting names like ["optim.lr"], got {value!r}')
        return tuple(value)
    if annotation == "tuple[float, float]":
        if not isinstance(value, list) or len(value) != 2:
            raise ConfigError(f"{key}: expected an array of two floats, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, "float") for i, v in enumerate(value))
    raise AssertionError(annotation)


def _float_in_range(key: str, value) -> float:
    """``value`` as a float, refused where it is not the number written: a literal beyond double precision's range
    that reads as 0 (``1e-400``), or, for a setting the kernels read as float32 (FLOAT32_KEYS), one that float32
    turns into inf or flushes towards 0."""
    text = getattr(value, "text", "")
    mantissa = text.lower().split("e")[0]
    if value == 0 and any(c in "123456789" for c in mantissa):
        raise ConfigError(f"{key}: {text} is below double precision's range and reads as 0; write 0 if 0 is meant")
    name = re.sub(r"\[\d+\]", "", key)  # optim.betas[1] -> optim.betas, model.layers[2].eps -> model.layers.eps
    if name in FLOAT32_KEYS or name.rsplit(".", 1)[-1] in FLOAT32_KEYS:
        shown_value = text or repr(float(value))
        if abs(value) > FLOAT32_MAX:
            raise ConfigError(f"{key}: {shown_value} overflows float32 (at most {FLOAT32_MAX:.7g}), which the "
                              "kernels compute in")
        if 0 < abs(value) < FLOAT32_TINY:
            raise ConfigError(f"{key}: {shown_value} is below float32's smallest normal number ({FLOAT32_TINY:.7g}), "
                              "which the kernels compute in: it would act as 0; write 0 if 0 is meant")
    return float(value)


def _int64(key: str, value: int) -> int:
    # tomllib accepts any size of integer; numpy and HDF5 attributes take int64 only
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(f"{key}: must fit in a 64-bit signed integer (at most 2**63 - 1), got {value}")
    return value


def _param_count(kind: str, args: dict) -> int:
    """Parameters of one layer, as the model lays them out (weight and bias)."""
    if kind == "linear":
        return args["in"] * args["out"] + (args["out"] if args["bias"] else 0)
    if kind == "layernorm":
        return 2 * args["dim"]
    plugin = registered(kind)
    if plugin is not None:  # a registered kind says its shapes once built (building allocates nothing)
        return sum(math.prod(shape) for _, shape in plugin.build(**args).params)
    return 0


def _plugin_layer(where: str, plugin, table: dict) -> LayerSpec:
    """A registered kind's table, checked against the keys it declared, with its defaults filled in."""
    args = {}
    for key, v in table.items():
        if key == "type":
            continue
        if key not in plugin.keys:
            raise ConfigError(f"{where}: unknown key {key!r} for a {plugin.name} layer (known: "
                              f"{', '.join(plugin.keys) or 'none'})")
        args[key] = _coerce(f"{where}.{key}", v, plugin.keys[key].__name__)
    for key in plugin.required:
        if key not in args:
            raise ConfigError(f"{where}: a {plugin.name} layer needs {key!r}")
    args = {**plugin.defaults, **args}
    from .nn.layers import Layer, not_a_layer

    try:
        layer = plugin.build(**args)
        names = [name for name, _ in layer.params] if isinstance(layer, Layer) else []
        shapes = [tuple(int(n) for n in shape) for _, shape in layer.params] if isinstance(layer, Layer) else []
    except Exception as e:  # the layer's own check of its arguments
        raise ConfigError(f"{where}: {plugin.name} layer ({plugin.module}): {type(e).__name__}: {e}") from None
    if not isinstance(layer, Layer):
        raise ConfigError(f"{where}: {not_a_layer(plugin.name, plugin, layer)}")
    if any(n < 1 for shape in shapes for n in shape):
        raise ConfigError(f"{where}: {plugin.name} layer: every parameter dimension must be >= 1, got {shapes}")
    bad = next((n for n in names if not isinstance(n, str) or not all(p.isidentifier() for p in n.split("."))), None)
    if bad is not None or len(set(names)) != len(names):
        what = f"{bad!r} is not a name (letters, digits and _, dotted as torch's fc.weight)" if bad is not None \
            else "a name repeats"
        raise ConfigError(f"{where}: {plugin.name} layer ({plugin.module}): its params {names}: {what}; each "
                          "parameter needs its own name, as torch.nn's do")
    return LayerSpec(plugin.name, tuple(sorted(args.items())))


def _parse_layers(value) -> tuple[LayerSpec, ...]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError("model.layers: expected an array of tables like {type = \"linear\", in = 64, out = 10}")
    layers, total = [], 0
    for i, table in enumerate(value):
        where = f"model.layers[{i}]"
        if "type" not in table:
            raise ConfigError(f"{where}.type: required (one of {', '.join(LAYER_KEYS)})")
        kind = table["type"]
        plugin = registered(kind) if isinstance(kind, str) else None
        if plugin is not None:
            layers.append(_plugin_layer(where, plugin, table))
            total += _param_count(kind, dict(layers[-1].args))
            continue
        if not isinstance(kind, str) or kind not in LAYER_KEYS:
            got = f"{_type_name(kind)} {kind!r}" if not isinstance(kind, str) else repr(kind)
            known = ", ".join((*LAYER_KEYS, *registered_names()))
            raise ConfigError(f"{where}.type: expected one of {known}, got {got} (a kind of your own is registered "
                              "by its module: hpctrain --plugin MODULE, or HPCTRAIN_PLUGINS=MODULE; `hpctrain inspect "
                              "CHECKPOINT` names a checkpoint's)")
        allowed = LAYER_KEYS[kind]
        args = {}
        for key, v in table.items():
            if key == "type":
                continue
            if key not in allowed:
                raise ConfigError(f"{where}: unknown key {key!r} for a {kind} layer (known: {', '.join(allowed) or 'none'})")
            args[key] = _coerce(f"{where}.{key}", v, allowed[key].__name__)
        for key in LAYER_REQUIRED.get(kind, ()):
            if key not in args:
                raise ConfigError(f"{where}: a {kind} layer needs {key!r}")
        for key in ("in", "out", "dim"):
            if key in args and args[key] < 1:
                raise ConfigError(f"{where}.{key}: must be >= 1, got {args[key]}")
        if kind == "linear":
            args.setdefault("bias", True)
        if kind == "layernorm":
            args.setdefault("eps", 1e-5)
            if args["eps"] <= 0:
                raise ConfigError(f"{where}.eps: must be > 0, got {args['eps']}")
        total += _param_count(kind, args)
        if total * 4 > INT64_MAX:  # no float32 buffer (params, grads) of this size can exist: numpy refuses it
            raise ConfigError(f"{where}: the model has {total:,} parameters up to here; a float32 buffer of "
                              f"that size exceeds 2**63 bytes")
        layers.append(LayerSpec(kind, tuple(sorted(args.items()))))
    return tuple(layers)


def setting_names() -> tuple[str, ...]:
    """Every setting as ``section.key`` (TOML spelling), e.g. "optim.lr", "checkpoint.async"."""
    return tuple(f"{name}.{_toml_key(f.name)}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls))


def _check_ranges(cfg: Config) -> None:
    def need(ok, key, what):
        if not ok:
            raise ConfigError(f"{key}: {what}")

    t, o, d, c, p, m = cfg.train, cfg.optim, cfg.data, cfg.checkpoint, cfg.parallel, cfg.model
    need(d.path, "data.path", "required (an HDF5 file)")
    if m.kind == "gpt":
        need(not m.layers, "model.layers", 'not used by kind = "gpt" (it is set by n_layer, n_head, n_embd)')
        for key in GPT_SIZES:
            need(getattr(m, key) >= 1, f"model.{key}", f"must be >= 1, got {getattr(m, key)}")
        need(m.n_embd % m.n_head == 0, "model.n_embd", f"{m.n_embd} is not divisible by model.n_head = {m.n_head}")
        need(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
        need(d.tokens, "data.tokens", 'required by kind = "gpt" (the name of a 1-D dataset of token ids)')
        need(not d.inputs and not d.targets, "data.inputs", 'kind = "gpt" reads data.tokens, not data.inputs '
             "and data.targets")
        need(t.loss == "cross_entropy", "train.loss", f'kind = "gpt" trains with cross_entropy, got {t.loss!r}')
        need(not d.corpus or d.tokens == "tokens", "data.tokens", 'data.corpus writes the dataset "tokens"; '
             f"set data.tokens = \"tokens\", got {d.tokens!r}")
    else:
        need(not d.corpus, "data.corpus", 'a bundled corpus is text for kind = "gpt"')
        need(m.layers, "model.layers", "the model needs at least one layer")
        need(d.inputs, "data.inputs", "required (the name of the input dataset)")
        need(d.targets, "data.targets", "required (the name of the target dataset)")
        need(not d.tokens, "data.tokens", 'token datasets are for kind = "gpt"; an MLP reads data.inputs and '
             "data.targets")
    need(0.0 <= d.val_fraction < 1.0, "data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
    need(d.sampling == "windows" or m.kind == "gpt", "data.sampling", '"random" draws token offsets: for kind = '
         '"gpt" (rows of an MLP\'s file are shuffled with data.shuffle)')
    need(not d.val_path or os.path.normpath(d.val_path) != os.path.normpath(d.path), "data.val_path",
         f"is data.path ({d.path}): the validation split would be training data")
    need(t.eval_batches >= 0, "train.eval_batches", f"must be >= 0 (0 = the whole validation split), got "
         f"{t.eval_batches}")
    unknown = [k for k in cfg.checkpoint.allow_changed if k not in setting_names()]
    need(not unknown, "checkpoint.allow_changed", f"{', '.join(map(repr, unknown))}: not a setting (names like "
         '"optim.lr", "train.batch_size")')
    for section, key in SEED_KEYS:
        seed = getattr(getattr(cfg, section), key)
        need(seed >= 0, f"{section}.{key}", f"must be in [0, 2**63 - 1] (a numpy seed), got {seed}")
    need(t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}")
    need(t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}")
    need(t.log_every >= 1, "train.log_every", f"must be >= 1, got {t.log_every}")
    need(t.eval_every >= 0, "train.eval_every", f"must be >= 0 (0 = only at the end), got {t.eval_every}")
    need(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0 (0 = off), got {t.grad_clip}")
    need(t.micro_batches >= 1, "train.micro_batches", f"must be >= 1, got {t.micro_batches}")
    S = t.deterministic_shards
    need(S >= 1 and S & (S - 1) == 0, "train.deterministic_shards", f"must be a power of two >= 1, got {S}")
    need(not (t.deterministic and p.mode == "async_ps"), "train.deterministic",
         'not with parallel.mode = "async_ps" (its updates arrive in the order the workers finish)')
    need(not (t.deterministic and p.reduce_dtype != "fp32"), "parallel.reduce_dtype",
         f'"{p.reduce_dtype}" is not available with train.deterministic, whose fixed tree adds in float32')
    need(not t.deterministic or t.batch_size % S == 0, "train.deterministic_shards",
         f"must divide train.batch_size = {t.batch_size} (every shard the same shape), got {S}")
    need(t.collective_timeout >= 0 and math.isfinite(t.collective_timeout), "train.collective_timeout",
         f"must be a number of seconds >= 0 (0 = off), got {t.collective_timeout}")
    need(0 <= t.peak_tflops < 1e9, "train.peak_tflops",
         f"must be one rank's peak in TFLOP/s (0 = from the device, measured on a CPU), got {t.peak_tflops}")
    need(t.max_skipped_steps >= 1, "train.max_skipped_steps", f"must be >= 1, got {t.max_skipped_steps}")
    need(o.lr >= 0, "optim.lr", f"must be >= 0, got {o.lr}")
    need(0 <= o.momentum < 1, "optim.momentum", f"must be in [0, 1), got {o.momentum}")
    need(not (o.nesterov and o.momentum <= 0), "optim.nesterov", "needs optim.momentum > 0 (as in torch.optim.SGD)")
    need(all(0 <= b < 1 for b in o.betas), "optim.betas", f"each must be in [0, 1), got {list(o.betas)}")
    need(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    need(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    need(0.0 <= o.min_lr <= o.lr, "optim.min_lr", f"must be in [0, optim.lr = {o.lr:g}], got {o.min_lr:g}")
    need(0 <= o.decay_min_ndim <= 8, "optim.decay_min_ndim", f"must be in [0, 8] (2: decay only matrices, as "
         f"nanoGPT does), got {o.decay_min_ndim}")
    need(not (o.decay_min_ndim and p.mode == "async_ps"), "optim.decay_min_ndim",
         'not supported with parallel.mode = "async_ps" yet (its servers update flat ranges, not tensors)')
    need(c.every >= 0, "checkpoint.every", f"must be >= 0 (0 = only at the end), got {c.every}")
    need(c.keep >= 1, "checkpoint.keep", f"must be >= 1, got {c.keep}")
    need(p.dp == "auto" or p.dp >= 1, "parallel.dp", f'must be >= 1 or "auto", got {p.dp}')
    need(p.pp >= 1, "parallel.pp", f"must be >= 1, got {p.pp}")
    need(p.tp >= 1, "parallel.tp", f"must be >= 1, got {p.tp}")
    need(p.virtual_stages >= 1, "parallel.virtual_stages", f"must be >= 1, got {p.virtual_stages}")
    if p.schedule == "interleaved-1f1b":
        need(p.virtual_stages >= 2, "parallel.virtual_stages", 'schedule = "interleaved-1f1b" needs virtual_stages '
             f">= 2 (model chunks per stage), got {p.virtual_stages}")
        need(p.pp >= 2, "parallel.schedule", f'"interleaved-1f1b" needs parallel.pp >= 2, got pp = {p.pp}')
        need(t.micro_batches % p.pp == 0, "train.micro_batches", f"must be a multiple of parallel.pp = {p.pp} for "
             f'schedule = "interleaved-1f1b" (micro-batches go round in groups of pp), got {t.micro_batches}')
        need(not t.deterministic, "train.deterministic", 'not with parallel.schedule = "interleaved-1f1b" yet (a '
             'micro-batch\'s gradient is written by several chunks); use "1f1b"')
    else:
        need(p.virtual_stages == 1, "parallel.virtual_stages", f"= {p.virtual_stages} needs parallel.schedule = "
             f'"interleaved-1f1b" (schedule {p.schedule!r} runs one model chunk per stage)')
    if p.stages and m.kind == "gpt":  # units: the embedding, the blocks, the head; each holds parameters
        _check_stages(p, m.n_layer + 2, lambda lo, hi: True, "the embedding 0, blocks 1..n_layer, the head")
    elif p.stages:
        layers = cfg.model.layers
        _check_stages(p, len(layers), lambda lo, hi: any(_param_count(l.type, dict(l.args)) for l in layers[lo : hi + 1]),
                      "model.layers")
    need(0 < p.bucket_mb <= 1e6, "parallel.bucket_mb", f"must be > 0 and at most 1e6 (a terabyte), got {p.bucket_mb}")
    need(p.servers >= 1, "parallel.servers", f"must be >= 1, got {p.servers}")
    need(p.staleness >= 0, "parallel.staleness", f"must be >= 0 (0 = synchronous), got {p.staleness}")
    need(isinstance(p.zero, int) and not isinstance(p.zero, bool) and p.zero in (0, 1, 2, 3), "parallel.zero",
         f"must be 0, 1, 2 or 3 (0: off; 1: optimizer state sharded over dp; 2: gradients too; 3: parameters "
         f"too), got {p.zero!r}")
    if p.zero == 3:
        from .parallel.zero3 import refusal

        need(not refusal(cfg), "parallel.zero", refusal(cfg))
    if p.mode == "async_ps":
        need(p.zero == 0, "parallel.zero", f'zero = {p.zero} with parallel.mode = "async_ps" is not supported (the '
             "parameter servers already hold the optimizer state in ranges); use zero = 0")
        for key in ("pp", "tp"):
            need(getattr(p, key) == 1, f"parallel.{key}", f'mode = "async_ps" with {key} = {getattr(p, key)} is '
                 "not supported (the parameter server trains whole models on its workers)")
        need(not t.skip_nonfinite, "train.skip_nonfinite", 'not supported with mode = "async_ps": a non-finite '
             "gradient stops the job")
        need(p.dp == "auto", "parallel.dp", 'mode = "async_ps": the workers are every rank but the servers; leave '
             'dp = "auto"')
        for key in ("debug_collectives", "collective_timeout"):
            need(not getattr(t, key), f"train.{key}", 'not supported with mode = "async_ps" yet (its servers and '
                 "workers talk point to point, by their own protocol)")


def _check_stages(p: "ParallelConfig", n: int, has_params, what: str) -> None:
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


def _toml_key(field: str) -> str:
    """The TOML key of a config field: a Python keyword ends in ``_`` as a field (``async_``), not in TOML."""
    return field[:-1] if field.endswith("_") and keyword.iskeyword(field[:-1]) else field


def _nearest(key: str, section: str | None) -> str:
    """'; did you mean X?' for an unknown key: a close spelling in its own section (or among the sections when
    ``section`` is None), else the same key in another section (``train.lr`` -> ``optim.lr``); '' when none."""
    import difflib

    if section is None:
        close = difflib.get_close_matches(key, list(SECTIONS), n=1, cutoff=0.6)
        return f"; did you mean [{close[0]}]?" if close else ""
    fields = [_toml_key(f.name) for f in dataclasses.fields(SECTIONS[section])]
    prefix = [f for f in fields if min(len(f), len(key)) >= 3 and (key.startswith(f) or f.startswith(key))]
    if prefix:  # zero_stage -> zero, batch -> batch_size
        return f"; did you mean {section}.{max(prefix, key=len)}?"
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.75)
    if close:
        return f"; did you mean {section}.{close[0]}?"
    elsewhere = [f"{name}.{key}" for name, cls in SECTIONS.items() if name != section
                 and key in {_toml_key(f.name) for f in dataclasses.fields(cls)}]
    if elsewhere:
        return f"; did you mean {elsewhere[0]}?"
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    return f"; did you mean {section}.{close[0]}?" if close else ""


# checkpoint.resume values that read as "never" or "auto" rather than as a path
_NEVER_LIKE = frozenset({"none", "no", "off", "false", "fresh", "new", "scratch"})
_AUTO_LIKE = frozenset({"latest", "last", "newest", "yes", "on", "true", "resume"})


def parse_config(data: dict, base_dir: str = ".", source: str = "<config>", *, cwd_keys=frozenset()) -> Config:
    """Build a Config from a parsed TOML document (a dict). A relative path resolves against ``base_dir``
    (the config file's folder), one of ``cwd_keys`` ((section, key) pairs given on the command line) against
    the working directory; a bare file name for ``train.metrics``, ``train.trace`` or ``train.tensorboard`` lands in
    ``checkpoint.dir`` when that is set (a new run folder keeps its own metrics)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config is a table of sections ([model], [data], ...), got {_type_name(data)}")
    base_dir = os.path.abspath(base_dir)  # the paths it holds are absolute: to_toml() reads back the same anywhere
    sections = {}
    for name, table in data.items():
        if not isinstance(name, str):
            raise ConfigError(f"a section name must be a string, got {name!r}")
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}]{_nearest(name, None)} (known: {', '.join(SECTIONS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}] must be a table, got {_type_name(table)}")
        cls = SECTIONS[name]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in table.items():
            full, given = f"{name}.{key}", key
            if keyword.iskeyword(key) and key + "_" in fields:  # ``async`` is the field ``async_``
                key = key + "_"
            elif key.endswith("_") and keyword.iskeyword(key[:-1]):
                key = ""  # ``async_``: the field's Python spelling, not a config key
            if key not in fields:
                raise ConfigError(f"{full}: unknown key{_nearest(given, name)} (known in [{name}]: "
                                  f"{', '.join(map(_toml_key, fields))})")
            if name == "model" and key == "layers":
                values[key] = _parse_layers(value)
                continue
            values[key] = _coerce(full, value, fields[key].type)
            if (name, key) == ("optim", "weight_decay") and values[key] < 0:
                raise ConfigError(f"{full}: must be >= 0, got {value!r}")
            choices = CHOICES.get((name, key))
            if choices and values[key] not in choices:
                raise ConfigError(f"{full}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
            here = os.getcwd() if (name, key) in cwd_keys else base_dir
            if (name, key) in PATH_KEYS and values[key]:
                values[key] = os.path.normpath(os.path.join(here, os.path.expanduser(values[key])))
            if (name, key) == ("checkpoint", "resume") and values[key] not in ("auto", "never"):
                if not values[key].strip() or values[key].strip().lower() in ("auto", "never"):
                    raise ConfigError(f'{full}: expected "auto", "never" or the path of a checkpoint, got '
                                      f"{value!r}" + ("" if not values[key].strip() else
                                                      f' (a file of that name: write it as "./{values[key]}")'))
                values[key] = os.path.normpath(os.path.join(here, os.path.expanduser(values[key])))
                word = value.strip().lower()
                meant = "never" if word in _NEVER_LIKE else "auto" if word in _AUTO_LIKE else ""
                if meant and not os.path.lexists(values[key]):  # not a checkpoint (or link) of that name either
                    raise ConfigError(f'{full}: expected "auto", "never" or the path of a checkpoint, got {value!r} '
                                      f'(no such file): did you mean "{meant}"?')
        sections[name] = cls(**values)
    model = data.get("model", {})
    if model.get("kind", "mlp") != "gpt":
        extra = [key for key in GPT_KEYS if key in model]
        if extra:
            raise ConfigError(f"model.{extra[0]}: only used by kind = \"gpt\" (this model is kind = "
                              f"{model.get('kind', 'mlp')!r})")
    folder = sections["checkpoint"].dir if "checkpoint" in sections else ""
    files = {k: v for k, v in data.get("train", {}).items() if k in ("metrics", "trace", "tensorboard") and isinstance(v, str)
             and v and os.path.basename(v) == v and v not in (".", "..")}
    if folder and files:  # bare names: inside the run's folder
        sections["train"] = dataclasses.replace(sections["train"], **{k: os.path.join(folder, v)
                                                                      for k, v in files.items()})
    if "model" in sections and sections["model"].kind == "gpt" and "vocab_size" not in model and "data" in sections:
        found = _data_vocab_size(sections["data"])  # nanoGPT's meta.pkl: the data says how many ids it has
        if found:
            sections["model"] = dataclasses.replace(sections["model"], vocab_size=found)
    cfg = Config(**sections, source=source)
    _check_ranges(cfg)
    return cfg


def _data_vocab_size(d: "DataConfig") -> int:
    """model.vocab_size when the config leaves it out: the vocabulary the token files (data.path, data.val_path)
    declare, else their largest id + 1; the bundled corpus's when data.path is still to be written; 0 when no
    file says (the start-up then reports the file's problem, and 50304 stands)."""
    from .data import token_vocab_size

    sizes = []
    for path in (d.path, d.val_path):
        if path and os.path.isfile(path) and d.tokens:
            sizes.append(token_vocab_size(path, d.tokens, allow_external=d.allow_external))
        elif path == d.path and d.corpus and path:
            from .text import CharTokenizer, corpus_text

            sizes.append(len(CharTokenizer.from_text(corpus_text(d.corpus))))
    return max(sizes, default=0)


def _parse_override(item: str):
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: the key must be section.key, got {key!r}")
    try:
        value = tomllib.loads(f"v = {text}", parse_float=_parse_float)["v"]
        # one TOML value and nothing after it: "3#x" parses as 3 with a comment, which [3#x] does not
        tomllib.loads(f"v = [{text}]")
    except tomllib.TOMLDecodeError:
        value = text  # not a TOML value: take it as a string
    except RecursionError:
        raise ConfigError(f"--set {item!r}: arrays or tables nested too deeply") from None
    return parts[0], parts[1], value


def apply_overrides(data: dict, overrides) -> dict:
    """``section.key=value`` overrides (``--set``) into a parsed TOML document ``data``; returns it."""
    for item in overrides:
        section, key, value = _parse_override(item)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table")
        table[key] = value
    return data


def load_config(path: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML config file and apply ``section.key=value`` overrides.

    Only a regular file of at most 16 MiB is read (a FIFO would block, /dev/zero never end).
    """
    text = read_capped(path, f"config file {path!r}", ConfigError, MAX_CONFIG_BYTES)
    try:
        # a byte order mark (some editors write one) is no TOML; floats keep their text (_float_in_range)
        data = tomllib.loads(text.decode("utf-8-sig"), parse_float=_parse_float)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ConfigError(f"{path}: malformed TOML: arrays or tables nested too deeply") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    apply_overrides(data, overrides)
    given = frozenset(tuple(_parse_override(item)[:2]) for item in overrides)  # command-line paths: from the cwd
    try:
        return parse_config(data, base_dir=os.path.dirname(os.path.abspath(path)), source=path, cwd_keys=given)
    except ConfigError as e:  # a quoted TOML key may hold a newline: the message stays one line
        raise ConfigError(shown(str(e))) from None


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):  # a TOML basic string: backslash, quote and every control character escaped
        return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                             for c in v) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML text; ``load_config`` of it gives the same Config."""
    lines = []
    for name in SECTIONS:
        section = getattr(cfg, name)
        lines.append(f"[{name}]")
        if name == "model" and section.kind == "gpt":
            lines += [f"{key} = {_toml_value(getattr(section, key))}" for key in ("kind",) + GPT_KEYS]
        elif name == "model":
            lines.append(f"kind = {_toml_value(section.kind)}")
            lines.append("layers = [")
            for layer in section.layers:
                inner = ", ".join(f"{k} = {_toml_value(v)}" for k, v in layer.as_dict().items())
                lines.append(f"  {{{inner}}},")
            lines.append("]")
        else:
            for f in dataclasses.fields(section):
                lines.append(f"{_toml_key(f.name)} = {_toml_value(getattr(section, f.name))}")
        lines.append("")
    return "\n".join(lines)
