"""The config's sections as frozen dataclasses, one per TOML table, and the names of their settings.

Every field is a setting of that section with its default; docs/config.md documents each. Parsing and checking
them is config/values.py, config/checks.py and config/load.py.
"""

from __future__ import annotations

import dataclasses
import keyword
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LayerSpec", "ModelConfig", "DataConfig", "TrainConfig", "OptimConfig", "CheckpointConfig",
           "ParallelConfig", "CudaConfig", "Config", "SECTIONS", "GPT_KEYS", "GPT_SIZES", "setting_names"]


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
class CudaConfig:
    """The CUDA backend's own settings (no effect on the CPU)."""

    arena: bool = True  # a training step's arrays planned from the step and replayed from one slab (backend/arena.py)
    graphs: bool | str = "auto"  # the arena's steps replayed as CUDA graphs, in segments (backend/cuda/graphs.py)
    gemm: str = "auto"  # the GEMM provider: "cublaslt", "numba" (tiled kernels), "auto" (backend/cuda/gemm/)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)
    source: str = field(default="", compare=False)  # the config file it came from, for messages

    def to_toml(self) -> str:
        from .to_toml import config_to_toml

        return config_to_toml(self)


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "parallel": ParallelConfig,
    "cuda": CudaConfig,
}

def _toml_key(field: str) -> str:
    """The TOML key of a config field: a Python keyword ends in ``_`` as a field (``async_``), not in TOML."""
    return field[:-1] if field.endswith("_") and keyword.iskeyword(field[:-1]) else field


def setting_names() -> tuple[str, ...]:
    """Every setting as ``section.key`` (TOML spelling), e.g. "optim.lr", "checkpoint.async"."""
    return tuple(f"{name}.{_toml_key(f.name)}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls))

