"""The few exceptions hpctrain raises for things a user can cause.

Every error a user can trigger (bad config, bad data, bad checkpoint, a world
size that does not fit the layout) is an ``HpctrainError``; the CLI prints its
message on one line with the rank and exits with status 2. Anything else is a
bug and aborts the job with a traceback.
"""

__all__ = [
    "HpctrainError",
    "ConfigError",
    "DataError",
    "BackendError",
    "LayoutError",
    "CheckpointError",
    "CheckpointInUseError",
    "NewerFormatError",
    "ModelMismatchError",
    "OptimizerMismatchError",
    "NonFiniteError",
]


class HpctrainError(Exception):
    """Base class: a problem with the user's input or environment."""


class ConfigError(HpctrainError):
    """The TOML config is malformed, has an unknown key or a wrong type."""


class DataError(HpctrainError):
    """The data file, a dataset in it, or its contents do not fit the job."""


class BackendError(HpctrainError):
    """A kernel got arrays it cannot work on, or the backend is unavailable."""


class LaunchError(HpctrainError):
    """The launcher and MPI disagree (e.g. srun started singleton worlds): each process is alone, nothing to abort."""

    collective = True


class LayoutError(HpctrainError):
    """World size, mesh or parameter layout disagree across ranks or with the config."""


class CheckpointError(HpctrainError):
    """A checkpoint or weights file is missing, corrupt, or does not fit the model."""


class NonFiniteError(HpctrainError):
    """A loss or gradient became NaN or Inf."""


class CheckpointInUseError(CheckpointError):
    """Another live job holds the lock on ``checkpoint.dir`` (hpctrain/checkpoint/lock.py)."""


class NewerFormatError(CheckpointError):
    """A checkpoint written by a newer hpctrain: valid, but this version cannot read it."""


class ModelMismatchError(CheckpointError):
    """A checkpoint that verifies but holds another model's tensors (names or shapes differ)."""



class OptimizerMismatchError(ModelMismatchError):
    """The checkpoint holds another optimizer's state: an older checkpoint would not fit either."""
