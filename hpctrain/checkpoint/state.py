"""What a checkpoint holds in host memory, and the value checks the writers and readers share."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import format as fmt

__all__ = ["CheckpointState", "check_slot_names", "nonfinite", "value_problem"]


@dataclass
class CheckpointState:
    """Everything a run needs to continue, in host memory.

    ``step`` counts training steps done (the next step to run); ``epoch`` and
    ``data_position`` (steps into that epoch) say where the data order stands,
    which is a pure function of (``rng``'s seed, step). ``layout`` is
    ``{"world_size", "dp", "pp", "tp"}`` of the run that wrote it (any layout may
    load it). ``params`` and each ``slots[slot]`` map PyTorch names to full,
    unsharded float32 arrays; ``optim_step`` is the optimizer's own step count
    (skipped non-finite steps do not count). ``vocabulary``: a language model's
    characters in token-id order, or "" (stored as the optional root attribute
    ``vocabulary``, a JSON array of code points). ``data_fingerprint``: what the run's data file held
    (data.fingerprint; the optional root attribute of that name), or "". ``path`` is set by the loaders.
    """

    step: int
    epoch: int
    data_position: int
    config_text: str
    layout: dict
    params: dict
    optim_name: str
    optim_step: int
    slots: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)
    vocabulary: str = ""
    tokenizer: str = ""  # subword tokens (hpctrain/tokens.py): JSON {"name", "sha256", "n_vocab"}, or ""
    data_fingerprint: str = ""
    path: str = ""
    version: int = fmt.SINGLE_FILE_VERSION  # 3: a sharded set (checkpoint/sharded.py)


def check_slot_names(optim_name: str, have: set, error):
    required, optional = fmt.OPTIMIZERS[optim_name]
    missing = [s for s in required if s not in have]
    unknown = sorted(have - set(required) - set(optional))
    if missing or unknown:
        allowed = ", ".join(required + optional) or "none"
        raise error(f"optimizer {optim_name} keeps slots {allowed}; "
                    + "; ".join(filter(None, [missing and "missing " + ", ".join(missing),
                                              unknown and "unexpected " + ", ".join(unknown)])))


def nonfinite(arr) -> str:
    """'' when every value of ``arr`` is finite, else how many are not (weights must be finite to load)."""
    arr = np.asarray(arr)
    if arr.size == 0 or np.isfinite(arr.min()) and np.isfinite(arr.max()):  # NaN propagates: two fast passes
        return ""
    finite = np.isfinite(arr)
    return "" if finite.all() else f"{finite.size - int(finite.sum())} non-finite value(s) (NaN or Inf)"


def value_problem(label: str, arr) -> str:
    """'' when the values of a parameter (``label`` "params") or optimizer slot can be trained on, else why not."""
    problem = nonfinite(arr)
    if not problem and label == "exp_avg_sq" and np.size(arr) and np.min(arr) < 0:  # a running mean of squares
        problem = f"{int((np.asarray(arr) < 0).sum())} negative value(s) (exp_avg_sq is >= 0)"
    return problem
