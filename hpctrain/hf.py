"""A GPT in Hugging Face's ``GPT2LMHeadModel`` layout: export to a folder, and weights from one.

    hpctrain export runs/gpt/ckpt-00001500.h5 out/gpt-hf --format hf     # model.safetensors + config.json
    [checkpoint]
    init = "out/gpt-hf"                                                  # or a downloaded gpt2 folder

The names are nanoGPT's (which are GPT-2's) plus ``lm_head.weight`` (tied: the same values as
``transformer.wte.weight``). GPT-2 keeps its attention and MLP weights in ``Conv1D`` layers, (in, out) where torch's
``Linear`` and hpctrain hold (out, in): ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc`` and ``mlp.c_proj`` weights
are transposed both ways, which is exact, so export then init gives the same parameters bit for bit. A model with
``bias = false`` is written with zero biases (GPT2LMHeadModel always has them); one read back needs them zero.
``config.json`` says ``activation_function = "gelu"``: hpctrain's GELU is the exact (erf) one, as nanoGPT's,
where GPT-2's own ``gelu_new`` is the tanh approximation (so OpenAI's GPT-2 weights compute a little differently
here, as they do in nanoGPT).
"""

from __future__ import annotations

import json
import os

import numpy as np

from .errors import CheckpointError, ConfigError

__all__ = ["to_hf", "from_hf", "write_hf", "read_hf", "is_hf_folder"]

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WEIGHTS, CONFIG = "model.safetensors", "config.json"


def _conv1d(name: str) -> bool:
    return name.startswith("transformer.h.") and name.split(".", 3)[3] in CONV1D


def _biases(m) -> list[str]:
    """The bias names GPT2LMHeadModel has that a ``bias = false`` model lacks."""
    names = ["transformer.ln_f.bias"]
    for i in range(m.n_layer):
        names += [f"transformer.h.{i}.{sub}.bias" for sub in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2",
                                                               "mlp.c_fc", "mlp.c_proj")]
    return names


def to_hf(params: dict, m) -> tuple[dict, dict]:
    """(tensors by GPT2LMHeadModel's names, config.json's dict) of a GPT's ``params`` (hpctrain names) and its
    ``[model]`` config ``m``."""
    out = {name: np.ascontiguousarray(a.T if _conv1d(name) else a) for name, a in params.items()}
    if not m.bias:
        C = m.n_embd
        widths = {"ln_1": C, "attn.c_attn": 3 * C, "attn.c_proj": C, "ln_2": C, "mlp.c_fc": 4 * C, "mlp.c_proj": C}
        for name in _biases(m):
            out[name] = np.zeros(C if name == "transformer.ln_f.bias" else widths[name.split(".", 3)[3][:-5]],
                                 dtype=np.float32)
    out["lm_head.weight"] = out["transformer.wte.weight"].copy()  # tied; written so a strict load finds it
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
              "n_positions": m.block_size, "n_ctx": m.block_size, "n_embd": m.n_embd, "n_layer": m.n_layer,
              "n_head": m.n_head, "n_inner": None, "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
              "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
              "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": m.vocab_size - 1,
              "eos_token_id": m.vocab_size - 1}
    return out, config


def from_hf(tensors: dict, layout, where: str) -> dict:
    """hpctrain's parameters (by ``layout``'s names and shapes) from GPT2LMHeadModel's ``tensors``; CheckpointError
    naming the first tensor missing or of another shape, or a nonzero bias a ``bias = false`` model has no room for."""
    out = {}
    for spec in layout:
        name, shape = spec.name, spec.shape
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name!r} (GPT2LMHeadModel's layout; the model needs "
                                  f"{tuple(shape)})")
        a = np.asarray(tensors[name])
        a = a.T if _conv1d(name) else a
        if tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{where}: {name} has shape {tuple(a.shape)} (as hpctrain holds it), the model "
                                  f"needs {tuple(shape)}: another model size (its config.json)")
        out[name] = np.ascontiguousarray(a, dtype=np.float32)
    if "lm_head.weight" in tensors and not np.array_equal(np.asarray(tensors["lm_head.weight"]),
                                                          np.asarray(tensors["transformer.wte.weight"])):
        raise CheckpointError(f"{where}: lm_head.weight differs from transformer.wte.weight; hpctrain's GPT ties them")
    extra = [n for n in tensors if n.endswith(".bias") and n not in out and n.startswith("transformer.")
             and not n.endswith(("attn.bias", "attn.masked_bias"))]
    nonzero = next((n for n in extra if np.any(np.asarray(tensors[n]))), None)
    if nonzero:
        raise CheckpointError(f"{where}: {nonzero} is not zero but the model has model.bias = false; set bias = true")
    return out


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, WEIGHTS))


def write_hf(folder: str, params: dict, m, metadata: dict, dtype: str = "fp32") -> int:
    """``model.safetensors`` and ``config.json`` of a GPT into ``folder`` (made if missing; each written aside and
    renamed); ``dtype`` "bf16": the tensors rounded to bfloat16 (``torch_dtype`` says so); returns the number of
    tensors."""
    from .export import as_dtype
    from ._files import replaced_atomically, write_bytes

    try:
        from safetensors.numpy import save
    except ImportError:
        raise ConfigError("export to Hugging Face's layout needs the safetensors package: pip install "
                          "'hpctrain[export]'") from None
    tensors, config = to_hf(params, m)
    if dtype == "bf16":
        tensors = {name: as_dtype(arr, dtype) for name, arr in tensors.items()}
        config["torch_dtype"] = "bfloat16"
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"export: cannot make the folder {folder}: {e.strerror or e}") from None
    # each file serialised in memory and written by us: a full disk is then an OSError, one line (_files.py)
    for name, data in ((WEIGHTS, save(tensors, metadata={"format": "pt", **metadata})),
                       (CONFIG, (json.dumps(config, indent=2) + "\n").encode())):
        path = os.path.join(folder, name)
        with replaced_atomically(path, f"export: cannot write {path}", CheckpointError) as tmp:
            write_bytes(tmp, data)
    return len(tensors)


def read_hf(folder: str, layout) -> dict:
    """hpctrain's parameters from a GPT2LMHeadModel folder (``checkpoint.init``): its model.safetensors, read
    without pickle (``read_widened``: float32, or bfloat16 as ``export --dtype bf16`` and bfloat16 Hugging Face
    models write it)."""
    path = os.path.join(folder, WEIGHTS)
    try:
        tensors = read_widened(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint.init {path} is not a readable safetensors file: {e}") from None
    return from_hf(tensors, layout, f"checkpoint.init {folder}")


WIDENED = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}  # safetensors dtype -> bytes an element


def read_widened(path: str) -> dict:
    """A safetensors file's tensors as float32, bfloat16 and float16 widened exactly (safetensors' numpy API has
    no bfloat16); ValueError naming what is wrong with a file that breaks the format."""
    import ml_dtypes

    kinds = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64}
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if n < 2 or 8 + n > len(data):
        raise ValueError("its header length is outside the file")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its header is not JSON: {e}") from None
    body, out = memoryview(data)[8 + n :], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            kind, shape, (lo, hi) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r}: its header entry lacks dtype, shape or data_offsets") from None
        if kind not in kinds:
            raise ValueError(f"tensor {name!r} is {kind}; hpctrain reads {', '.join(kinds)}")
        if not (0 <= lo <= hi <= len(body)) or hi - lo != WIDENED[kind] * int(np.prod(shape)):
            raise ValueError(f"tensor {name!r}: its data_offsets [{lo}, {hi}) do not hold {kind}{shape}")
        out[name] = np.frombuffer(body[lo:hi], dtype=kinds[kind]).reshape(shape).astype(np.float32)
    return out
