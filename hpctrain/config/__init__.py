"""TOML config -> frozen dataclasses.

A config has the sections ``[model] [data] [train] [optim] [checkpoint]
[parallel]``; docs/config.md documents every key. Unknown sections or keys and
values of the wrong type raise ``ConfigError`` naming the key. Relative paths
in the file resolve against the folder of the config file; those given as
overrides (``--set``) against the working directory, as on any command line
(a bare file name for ``train.metrics``, ``trace`` or ``tensorboard`` lands in
``checkpoint.dir`` either way).

    cfg = load_config("jobs/configs/digits.toml", ["train.steps=100"])

One job a module: sections.py the dataclasses (a section each) and the settings' names; values.py one value
checked against its field (and ``model.layers``' tables); checks.py the settings checked together;
load.py TOML text and ``--set`` overrides -> Config; to_toml.py Config -> canonical TOML.
"""

from __future__ import annotations

from .load import _parse_override, apply_overrides, load_config, parse_config
from .sections import (GPT_KEYS, SECTIONS, CheckpointConfig, Config, DataConfig, LayerSpec, ModelConfig,
                       OptimConfig, ParallelConfig, TrainConfig, CudaConfig, setting_names)
from .to_toml import config_to_toml
from .values import INT64_MAX

__all__ = ["Config", "LayerSpec", "load_config", "parse_config", "config_to_toml"]
