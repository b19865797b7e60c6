"""hpctrain: MPI-based training with Numba kernels, for HPC users who train without a framework.

    mpiexec -n 2 hpctrain train jobs/configs/digits.toml
"""

from ._threads import share_cores_between_local_ranks

share_cores_between_local_ranks()  # before anything imports numpy

from .config import Config, load_config
from .errors import CheckpointError, ConfigError, DataError, HpctrainError, LayoutError
from .train import Trainer

__version__ = "0.1.0"
__all__ = ["Config", "load_config", "Trainer", "HpctrainError", "ConfigError", "DataError", "LayoutError",
           "CheckpointError", "__version__"]
