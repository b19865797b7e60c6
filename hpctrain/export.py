"""``hpctrain export``: a checkpoint's parameters for the PyTorch and Hugging Face ecosystem, or one HDF5 file.

    hpctrain export runs/gpt/ckpt-00001500.h5 model.safetensors         # the parameters, PyTorch names
    hpctrain export runs/gpt/ckpt-00001500.h5 whole.h5 --format h5      # the whole checkpoint in one file
    hpctrain export runs/gpt/ckpt-00001500.h5 out/ckpt.pt               # nanoGPT's checkpoint (needs torch)

``safetensors``: the parameters only, named and shaped as ``state_dict()`` (nanoGPT's names for a
GPT), float32, written with the ``safetensors`` package's numpy API (``pip install
'hpctrain[export]'``); ``torch`` loads them with ``safetensors.torch.load_file`` and
``model.load_state_dict``. The file's metadata holds the step and the config. ``h5``: a
single-file checkpoint (format version 2: every tensor and the optimizer state in the file, its
sha256 per dataset) that needs no shard folder beside it; hpctrain resumes, samples and inspects it
like any checkpoint. ``nanogpt`` (a ``.pt`` output): a GPT checkpoint as nanoGPT's train.py saves one,
``torch.save`` of {"model": its state_dict (the tied ``lm_head.weight`` included), "model_args" (GPTConfig's
keys), "iter_num", "best_val_loss", "config"}, so nanoGPT's sample.py (``init_from = "resume"``,
``out_dir`` the folder) loads it; no optimizer state (nanoGPT's AdamW groups are not hpctrain's flat buffer), so
nanoGPT's train.py starts its optimizer afresh from it. The checkpoint is read and verified first, whichever
format; an existing output is replaced only with ``force``. ``--dtype bf16`` writes the parameters (safetensors,
nanogpt, hf) rounded to bfloat16 from the checkpoint's float32 master copy, half the bytes; hpctrain reads such
a file back (``checkpoint.init``) widened to float32 exactly.
"""

from __future__ import annotations

import os

from ._files import check_replaceable, replaced_atomically, write_bytes
from .errors import CheckpointError, ConfigError

__all__ = ["export", "FORMATS"]

FORMATS = ("safetensors", "h5", "nanogpt", "hf")
DTYPES = ("fp32", "bf16")
EXTENSIONS = {".safetensors": "safetensors", ".h5": "h5", ".hdf5": "h5", ".pt": "nanogpt"}


def export(path: str, out: str, fmt: str = "", force: bool = False, dtype: str = "fp32") -> str:
    """Write checkpoint ``path`` to ``out`` (format from ``fmt`` or ``out``'s extension); a line to print.
    ``dtype`` "bf16": the parameters rounded to bfloat16 (to nearest even) from the checkpoint's float32 master
    copy, for the formats that hold parameters only."""
    import tomllib

    from . import checkpoint as ckpt
    from .config import parse_config
    from .nn import make_model

    fmt = _checked_request(path, out, fmt, force, dtype)
    meta = ckpt.read_meta(path)
    try:
        cfg = parse_config(tomllib.loads(meta.config_text), source=f"{path} (its config)")
    except tomllib.TOMLDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: its config attribute is not TOML: {e}") from None
    if fmt == "hf" and cfg.model.kind != "gpt":
        raise ConfigError(f"export: Hugging Face's GPT2LMHeadModel holds a GPT; {path} is a model.kind = "
                          f"{cfg.model.kind!r} checkpoint (export it to .safetensors)")
    if fmt == "hf":
        from .hf import write_hf

        state = ckpt.load_checkpoint(path, make_model(cfg.model).layout)
        n = write_hf(out, state.params, cfg.model, {"hpctrain_step": str(state.step),
                                                    "hpctrain_config": state.config_text}, dtype=dtype)
        return (f"{out}: model.safetensors ({n} tensors{_in(dtype)}, GPT2LMHeadModel's names, lm_head.weight "
                f"tied) and config.json; transformers.GPT2LMHeadModel.from_pretrained({out!r}) loads it")
    if fmt == "nanogpt" and cfg.model.kind != "gpt":
        raise ConfigError(f"export: nanoGPT's ckpt.pt holds a GPT; {path} is a model.kind = {cfg.model.kind!r} "
                          "checkpoint (export it to .safetensors)")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ConfigError(f"export: the folder of {out} does not exist (make it first: mkdir -p "
                          f"{os.path.dirname(out) or '.'})")
    torch = _torch() if fmt == "nanogpt" else None
    state = ckpt.load_checkpoint(path, make_model(cfg.model).layout)
    if fmt == "nanogpt":
        import io

        buf = io.BytesIO()  # serialised in memory, written by us: a full disk is an OSError, not torch's error
        torch.save(nanogpt_checkpoint(torch, state, cfg, dtype), buf)
        with replaced_atomically(out, f"export: cannot write {out}", CheckpointError) as tmp:
            write_bytes(tmp, buf.getbuffer())
        return (f"{out}: nanoGPT's checkpoint of {len(state.params) + 1} tensors{_in(dtype)} (lm_head.weight tied to "
                f"transformer.wte.weight), iter_num {state.step}; sample with nanoGPT's sample.py --out_dir="
                f"{os.path.dirname(out) or '.'}")
    if fmt == "h5":
        ckpt.write_single_file(out, state)
        version = ckpt.read_meta(out).version  # what the file says, as `hpctrain inspect` reads it
        source = f" (the source, a sharded set, is version {meta.version})" if meta.version != version else ""
        return (f"{out}: the whole checkpoint (step {state.step}) in one HDF5 file, format version {version}"
                f"{source}")
    try:
        from safetensors.numpy import save
    except ImportError:
        raise ConfigError("export to safetensors needs the safetensors package: pip install 'hpctrain[export]'") \
            from None
    tokens = {"hpctrain_tokenizer": state.tokenizer} if state.tokenizer else {}  # what decodes its ids
    if state.vocabulary:
        tokens["hpctrain_vocabulary"] = state.vocabulary
    tensors = {name: as_dtype(arr, dtype) for name, arr in state.params.items()}
    if cfg.model.kind == "gpt":  # the tied head under its own name too: a strict nanoGPT load wants it
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"].copy()
    data = save(tensors,  # serialised in memory: a full disk is then our OSError, not SafetensorError
                metadata={"format": "pt", "hpctrain_step": str(state.step), "hpctrain_config": state.config_text,
                          **tokens})
    with replaced_atomically(out, f"export: cannot write {out}", CheckpointError) as tmp:
        write_bytes(tmp, data)
    n = sum(a.size for a in state.params.values())
    return f"{out}: {len(state.params)} tensors, {n:,} parameters (step {state.step}), safetensors{_in(dtype)}"


def as_dtype(arr, dtype: str):
    """A float32 parameter as exported: itself, or rounded to bfloat16 to nearest even (ml_dtypes' cast, which
    safetensors writes as BF16)."""
    if dtype == "fp32":
        return arr
    import ml_dtypes

    return arr.astype(ml_dtypes.bfloat16)


def _in(dtype: str) -> str:
    return "" if dtype == "fp32" else " in bfloat16"


def _checked_request(path: str, out: str, fmt: str, force: bool, dtype: str) -> str:
    """The format to write; ConfigError for a request refused before the checkpoint is read."""
    fmt = fmt or EXTENSIONS.get(os.path.splitext(out)[1], "")
    if fmt not in FORMATS:
        raise ConfigError(f"export: cannot tell the format of {out} from its extension; give --format "
                          f"({' or '.join(FORMATS)})")
    if dtype not in DTYPES:
        raise ConfigError(f"export: --dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype != "fp32" and fmt == "h5":
        raise ConfigError("export: --dtype bf16 writes parameters only; the h5 format is the whole checkpoint, "
                          "whose float32 master state a resume needs (export bf16 weights to .safetensors, .pt or "
                          "--format hf)")
    check_replaceable(out, f"export: cannot write {out}", ConfigError)  # never a device or FIFO, --force or not
    if os.path.abspath(out) == os.path.abspath(path) or (os.path.exists(out) and os.path.exists(path)
                                                         and os.path.samefile(out, path)):
        raise ConfigError(f"export: {out} is the checkpoint itself")
    if os.path.exists(out) and not force:
        raise ConfigError(f"export: {out} exists; pass --force to replace it")
    return fmt


def _torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("export to nanoGPT's ckpt.pt needs torch importable (pip install torch); "
                          ".safetensors needs only numpy") from None
    return torch


def nanogpt_checkpoint(torch, state, cfg, dtype: str = "fp32") -> dict:
    """What nanoGPT's train.py saves (less the optimizer): the state dict with the tied head, GPTConfig's keys;
    ``dtype`` "bf16": torch.bfloat16 tensors (torch's cast, to nearest even)."""
    from collections import OrderedDict

    m = cfg.model
    model = OrderedDict((name, torch.from_numpy(arr.copy())) for name, arr in state.params.items())
    if dtype == "bf16":
        model = OrderedDict((name, t.to(torch.bfloat16)) for name, t in model.items())
    model["lm_head.weight"] = model["transformer.wte.weight"]  # tied, as nanoGPT's GPT holds it
    model_args = dict(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, block_size=m.block_size, bias=m.bias,
                      vocab_size=m.vocab_size, dropout=m.dropout)
    return {"model": model, "model_args": model_args, "iter_num": int(state.step),
            "best_val_loss": float("inf"),  # not recorded in hpctrain's checkpoints (its metrics file has it)
            "config": {**model_args, "learning_rate": cfg.optim.lr, "max_iters": cfg.train.steps,
                       "batch_size": cfg.train.batch_size, "init_from": "scratch"}}
