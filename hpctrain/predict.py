"""``hpctrain predict``: a checkpoint's outputs for every sample of a file, written to HDF5.

    hpctrain predict runs/digits/ckpt-00000600.h5 --data new.h5 --out predictions.h5
    hpctrain predict runs/gpt-char/ckpt-00001500.h5 --data tokens.h5 --out next.h5   # next-token logits

One process (no MPI), on ``--backend`` (``auto``: a GPU when there is one). The checkpoint's config
defines the model and names the input dataset (``data.inputs`` for an MLP, ``data.tokens`` for a GPT;
``--inputs NAME`` picks another). The output file holds ``outputs`` (float32: an MLP's outputs, the
logits for a classifier; a GPT's logits of the token after each window of ``block_size`` ids) and, for
a classifier or a GPT, ``predictions`` (int64, the argmax). Samples go through in chunks of
``--batch``; nothing else is kept, so the file may be larger than memory. The output is written under a
temporary name and renamed into place.
"""

from __future__ import annotations

import os
import tomllib

import h5py
import numpy as np

from . import checkpoint as ckpt
from ._files import check_replaceable, h5_output, replaced_atomically
from .errors import CheckpointError, ConfigError, DataError

__all__ = ["predict"]


def predict(checkpoint: str, data: str, out: str, *, inputs: str = "", batch: int = 1024, backend: str = "auto",
            force: bool = False) -> str:
    """Write ``checkpoint``'s outputs for every sample of ``data`` to ``out``; returns a one-line summary."""
    from .backend import get_backend
    from .config import parse_config
    from .nn import make_model
    from .params import FlatBuffer

    if batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {batch}")
    check_replaceable(out, f"cannot write {out}", DataError)  # never a device or FIFO, --force or not
    if os.path.exists(out):
        if os.path.exists(data) and os.path.samefile(data, out):
            raise DataError(f"{out} is the input file itself")
        if os.path.exists(checkpoint) and os.path.samefile(checkpoint, out):  # --force would destroy it
            raise DataError(f"{out} is the checkpoint itself")
        if not force:
            raise DataError(f"{out} exists; pass --force to replace it")
    meta = ckpt.read_meta(checkpoint)
    if not meta.config_text:
        raise CheckpointError(f"{checkpoint} carries no config: predict needs a checkpoint (ckpt-*.h5)")
    try:
        cfg = parse_config(tomllib.loads(meta.config_text), source=f"{checkpoint} (its config)")
    except tomllib.TOMLDecodeError as e:
        raise CheckpointError(f"checkpoint {checkpoint}: its config attribute is not TOML: {e}") from None
    model = make_model(cfg.model)
    part = model.part()
    be = get_backend(backend)
    params, grads = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
    params.load_host_dict(part.local_tensors(ckpt.load_weights(checkpoint, model.layout)))
    part.bind(params, grads)
    gpt = cfg.model.kind == "gpt"
    n, read = _token_windows(cfg, model, data, inputs, checkpoint, meta) if gpt else _table(cfg, part, data, inputs)
    classify = gpt or cfg.train.loss == "cross_entropy"
    width = part.out_features
    with replaced_atomically(out, f"cannot write {out}", DataError) as tmp, \
            h5_output(tmp, f"cannot write {out}", DataError) as f:
        outputs = f.create_dataset("outputs", shape=(n, width), dtype=np.float32, chunks=True)
        labels = f.create_dataset("predictions", shape=(n,), dtype=np.int64, chunks=True) if classify else None
        for lo in range(0, n, batch):
            hi = min(n, lo + batch)
            x = read(lo, hi)
            y, _ = part.forward(be, be.asarray(x))
            y = be.to_host(y)
            if gpt:  # the logits after each window's last id: the next token's
                y = y.reshape(hi - lo, part.positions, width)[:, -1]
            outputs[lo:hi] = y
            if labels is not None:
                labels[lo:hi] = np.argmax(y, axis=1)
        f.attrs["checkpoint"] = os.path.abspath(checkpoint)
    what = "next-token logits and predictions" if gpt else "logits and predictions" if classify else "outputs"
    names = "'outputs' and 'predictions'" if classify else "'outputs'"
    return f"{out}: {what} for {n:,} {'windows' if gpt else 'samples'} of {data} (datasets {names})"


def _table(cfg, part, data, inputs):
    """(rows, read(lo, hi) -> float32 inputs) of an MLP's input dataset, checked as training checks it."""
    from .data import _get_dataset, _open_h5

    name = inputs or cfg.data.inputs
    f = _open_h5(data)
    x = _get_dataset(f, data, name, "--inputs" if inputs else "data.inputs",
                     f"(N, ...) with {part.in_features} features per row", cfg.data.allow_external)
    features = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
    if x.ndim < 1 or features != part.in_features:
        raise DataError(f"{data}: {name!r} has shape {x.shape}: the model takes {part.in_features} features per row")
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise DataError(f"{data}: {name!r} must hold real numbers, got dtype {x.dtype}")

    def read(lo, hi):
        stored = np.asarray(x[lo:hi])
        with np.errstate(over="ignore", invalid="ignore"):  # said below, in one line, with the stored value
            rows = stored.astype(np.float32).reshape(hi - lo, features)
        bad = ~np.isfinite(rows)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            value = stored.reshape(hi - lo, features)[r, c]
            beyond = " (beyond float32's range)" if np.isfinite(value) else ""
            raise DataError(f"{data}: {name!r} row {lo + r}, value {c} is {value}{beyond}: every input must be finite")
        return rows

    return x.shape[0], read


def _token_windows(cfg, model, data, tokens, checkpoint, meta):
    """(windows, read(lo, hi) -> ids (n, block_size)) of a GPT's token file, checked as training checks it (and
    refused when its ids are of another vocabulary or tokenizer than the checkpoint's, as resume refuses it)."""
    from .data import TokenDataset, token_mismatch

    ds = TokenDataset(data, tokens or cfg.data.tokens or "tokens", block_size=model.block_size, val_fraction=0.0,
                      vocab_size=model.vocab_size, allow_external=cfg.data.allow_external)
    problem = token_mismatch(checkpoint, meta, ds)
    if problem:
        ds.close()
        raise DataError(problem)
    bad = ds.scan(0, ds.n_train)
    if bad:
        raise DataError(bad)
    return ds.n_train, lambda lo, hi: ds.read(np.arange(lo, hi))[0]
