"""HDF5 checkpoints and weights files; docs/checkpoint-format.md describes the files.

A weights-only file is HDF5 with a group ``/params`` holding one float32
dataset per parameter, named and shaped as torch's ``state_dict()``. A
checkpoint adds root attributes (format, version, step, data position, config,
layout, optimizer, RNG settings) and the optimizer slots under
``/optim/<slot>/<name>``; every dataset carries a checksum that the loaders check.

One process writing a whole state (nothing here is collective):

    state = CheckpointState(step=..., epoch=..., data_position=..., config_text=cfg.to_toml(), ...)
    path = save_checkpoint(cfg.checkpoint.dir, state, keep=cfg.checkpoint.keep)
    state = find_resume(cfg.checkpoint.dir, model.layout, log)    # resume = "auto"; None if no checkpoint
    state = load_checkpoint(path, model.layout, optim_name="adam")

A file appears under its final name ``ckpt-<step:08d>.h5`` only once it is
complete: it is written to a hidden temp file in the same directory, fsynced,
renamed into place and the directory fsynced.

The modules: ``format`` (names, digests, attributes on disk), ``state`` (CheckpointState
and the value checks), ``write``, ``read``, ``pieces`` (what each rank holds of each tensor),
``sharded`` (a rank's shard, the index over the shards), ``sets`` (a set's names on disk; which
sets may be removed, and orphans), ``describe`` (``hpctrain inspect``) and ``lock`` (one job per
checkpoint folder).
"""

from __future__ import annotations

from .format import list_checkpoints
from .read import find_resume, load_checkpoint, load_weights, read_meta
from .state import CheckpointState
from .write import save_checkpoint, save_weights, write_single_file

__all__ = ["CheckpointState", "save_checkpoint", "load_checkpoint", "read_meta", "find_resume", "list_checkpoints",
           "inspect", "save_weights", "load_weights", "write_single_file"]


def inspect(path: str) -> tuple[str, bool]:
    """A readable description of a checkpoint or weights file and whether every checksum verifies
    (``hpctrain inspect PATH``; checkpoint/describe.py). Files never raise here."""
    from .describe import inspect as describe

    return describe(path)
