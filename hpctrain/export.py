"""``hpctrain export``: a checkpoint's parameters for the PyTorch and Hugging Face ecosystem, or one HDF5 file.

    hpctrain export runs/gpt/ckpt-00001500.h5 model.safetensors         # the parameters, PyTorch names
    hpctrain export runs/gpt/ckpt-00001500.h5 whole.h5 --format h5      # the whole checkpoint in one file

``safetensors``: the parameters only, named and shaped as ``state_dict()`` (nanoGPT's names for a
GPT), float32, written with the ``safetensors`` package's numpy API (``pip install
'hpctrain[export]'``); ``torch`` loads them with ``safetensors.torch.load_file`` and
``model.load_state_dict``. The file's metadata holds the step and the config. ``h5``: a
single-file checkpoint (format version 2: every tensor and the optimizer state in the file, its
sha256 per dataset) that needs no shard folder beside it; hpctrain resumes, samples and inspects it
like any checkpoint. The checkpoint is read and verified first, whichever format.
"""

from __future__ import annotations

import os

from ._files import replaced_atomically
from .errors import CheckpointError, ConfigError

__all__ = ["export", "FORMATS"]

FORMATS = ("safetensors", "h5")


def export(path: str, out: str, fmt: str = "") -> str:
    """Write checkpoint ``path`` to ``out`` (format from ``fmt`` or ``out``'s extension); a line to print."""
    import tomllib

    from . import checkpoint as ckpt
    from .config import parse_config
    from .nn import make_model

    fmt = fmt or {".safetensors": "safetensors", ".h5": "h5", ".hdf5": "h5"}.get(os.path.splitext(out)[1], "")
    if fmt not in FORMATS:
        raise ConfigError(f"export: cannot tell the format of {out} from its extension; give --format "
                          f"({' or '.join(FORMATS)})")
    if os.path.abspath(out) == os.path.abspath(path):
        raise ConfigError(f"export: {out} is the checkpoint itself")
    meta = ckpt.read_meta(path)
    try:
        layout = make_model(parse_config(tomllib.loads(meta.config_text), source=f"{path} (its config)").model).layout
    except tomllib.TOMLDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: its config attribute is not TOML: {e}") from None
    state = ckpt.load_checkpoint(path, layout)
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ConfigError(f"export: the folder of {out} does not exist")
    if fmt == "h5":
        ckpt.write_single_file(out, state)
        return f"{out}: the whole checkpoint (step {state.step}) in one HDF5 file, format version 2"
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise ConfigError("export to safetensors needs the safetensors package: pip install 'hpctrain[export]'") \
            from None
    with replaced_atomically(out, f"export: cannot write {out}", CheckpointError) as tmp:
        save_file(dict(state.params), tmp,
                  metadata={"format": "pt", "hpctrain_step": str(state.step), "hpctrain_config": state.config_text})
    n = sum(a.size for a in state.params.values())
    return f"{out}: {len(state.params)} tensors, {n:,} parameters (step {state.step}), safetensors"
