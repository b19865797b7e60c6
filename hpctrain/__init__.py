"""hpctrain: MPI-based training with Numba kernels, for HPC users who train without a framework.

    mpiexec -n 2 hpctrain train jobs/configs/digits.toml
"""

import sys as _sys

if _sys.argv[1:2] == ["train"] and _sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1] in ("hpctrain", "-m"):
    # ``hpctrain train`` (the console script, or python -m hpctrain while it is located): stop signals are
    # recorded from here, before numpy, mpi4py and MPI start (train/stop.py)
    from .train.stop import early as _early

    _early()

from ._threads import share_cores_between_local_ranks

share_cores_between_local_ranks()  # before anything imports numpy

from .errors import CheckpointError, ConfigError, DataError, HpctrainError, LayoutError

__version__ = "0.1.0"
__all__ = ["Config", "load_config", "Trainer", "register_layer", "HpctrainError", "ConfigError", "DataError", "LayoutError",
           "CheckpointError", "__version__"]

# imported on first use: the command line installs its signal handlers before numpy and h5py load (0.4 s)
_LAZY = {"Config": "config", "load_config": "config", "Trainer": "train", "register_layer": "layer_kinds"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hpctrain' has no attribute {name!r}")
