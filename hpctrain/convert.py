"""Your own data into hpctrain's files: ``hpctrain data csv2h5 | npz2h5 | bin2h5``.

    hpctrain data csv2h5 iris.csv iris.h5 --target species     # numeric columns -> inputs, one column -> targets
    hpctrain data npz2h5 arrays.npz data.h5 --inputs X --targets y
    hpctrain data bin2h5 train.bin tokens.h5 --vocab-from input.txt   # nanoGPT's prepare.py output

The tables (CSV, NPZ) become the datasets ``inputs`` (float32, one row a sample) and ``targets``
(int64 class labels when every target is a whole number, else float32), which a config reads with
``data.inputs = "inputs"`` and ``data.targets = "targets"``. A nanoGPT ``.bin`` (uint16 token ids, no
header) becomes the token dataset ``tokens``; ``--vocab-from`` names the text nanoGPT's character-level
prepare.py read, whose sorted characters are its vocabulary (nanoGPT keeps it in a pickle, ``meta.pkl``,
which hpctrain never loads), so ``hpctrain sample`` decodes it. Every output is written to a temporary
file and renamed into place; bad input is one line naming the file, row and column.
"""

from __future__ import annotations

import csv
import io
import struct
import zipfile
import zlib

import h5py
import numpy as np

from ._files import h5_output, read_capped, regular_file, replaced_atomically, shown
from .errors import DataError
from .text import TOKENS, CharTokenizer

__all__ = ["csv_to_h5", "npz_to_h5", "bin_to_h5"]

MAX_BYTES = 1 << 34  # 16 GiB: what one conversion reads


def _write_table(path: str, x: np.ndarray, y: np.ndarray, regression: bool = False, *, source: str = ""
                 ) -> tuple[np.ndarray, np.ndarray]:
    """inputs float32 (n, features), targets int64 labels (whole numbers >= 0, unless ``regression``) or
    float32 values; written atomically. ``source``: the file they came from, named in what is wrong with them."""
    at = f"{source}: " if source else ""
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or len(x) == 0 or x.shape[1] == 0:
        raise DataError(f"{at}the inputs must be a non-empty table of samples × features, got shape {x.shape}")
    if len(y) != len(x):
        raise DataError(f"{at}{len(x)} rows of inputs but {len(y)} targets")
    if y.ndim not in (1, 2):  # a model's output is one row of values per sample
        raise DataError(f"{at}the targets must be one value or one row of values per sample, got shape {y.shape}")
    if not (np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.number)) or \
            np.issubdtype(x.dtype, np.complexfloating) or np.issubdtype(y.dtype, np.complexfloating):
        raise DataError(f"{at}inputs and targets must be real numbers, got {x.dtype} and {y.dtype}")
    bad = ~np.isfinite(x.astype(np.float64))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise DataError(f"{at}input row {r}, column {c} is {x[r, c]}: every value must be finite")
    yf = y.astype(np.float64)
    if not np.isfinite(yf).all():
        raise DataError(f"{at}target row {int(np.argmax(~np.isfinite(yf)))} is not finite")
    labels = not regression and y.ndim == 1 and np.all(yf == np.round(yf)) and yf.min() >= 0
    if labels and yf.max() >= 2.0**63:  # no int64 label: the cast would make it -2**63
        raise DataError(f"{at}target row {int(np.argmax(yf))} is {yf.max():g}: whole numbers this large are no class "
                        "label (int64); pass --regression to keep the targets as float32 values")
    targets = yf.astype(np.int64) if labels else yf.astype(np.float32)
    inputs = x.astype(np.float32)
    with replaced_atomically(path, f"cannot write {path}", DataError) as tmp, \
            h5_output(tmp, f"cannot write {path}", DataError) as f:
        f.create_dataset("inputs", data=inputs, chunks=True)
        f.create_dataset("targets", data=targets, chunks=True)
    return inputs, targets


def csv_to_h5(source: str, path: str, *, target: str, header: bool | None = None, regression: bool = False) -> str:
    """A numeric CSV table: column ``target`` (its header name, or its 0-based index) -> targets, the rest ->
    inputs. ``header``: whether the first row names the columns (None: when it is not all numbers)."""
    raw = read_capped(source, f"CSV file {source}", DataError, MAX_BYTES)
    try:
        rows = [r for r in csv.reader(io.StringIO(raw.decode("utf-8-sig"))) if r and any(c.strip() for c in r)]
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{source}: not a UTF-8 CSV table: {e}") from None
    if not rows:
        raise DataError(f"{source}: no rows")
    if header is None:
        header = not all(_is_number(c) for c in rows[0])
    names = [c.strip() for c in rows[0]] if header else [str(i) for i in range(len(rows[0]))]
    body = rows[1:] if header else rows
    if target in names:
        t = names.index(target)
    elif target.isdigit() and int(target) < len(names):
        t = int(target)
    else:
        raise DataError(f"{source}: no column {target!r} (columns: {', '.join(names)})")
    width = len(names)
    values = np.empty((len(body), width), dtype=np.float64)
    for i, row in enumerate(body):
        line = i + 1 + bool(header)
        if len(row) != width:
            raise DataError(f"{source}: line {line} has {len(row)} columns, the first has {width}")
        for j, cell in enumerate(row):
            try:
                values[i, j] = float(cell)
            except ValueError:
                raise DataError(f"{source}: line {line}, column {names[j]!r}: {cell.strip()[:40]!r} is not a "
                                "number") from None
    if not len(body):
        raise DataError(f"{source}: a header and no rows")
    x, y = np.delete(values, t, axis=1), values[:, t]
    inputs, targets = _write_table(path, x, y, regression, source=source)
    return _table_summary(path, inputs, targets)


def npz_to_h5(source: str, path: str, *, inputs: str, targets: str, regression: bool = False) -> str:
    """Arrays ``inputs`` and ``targets`` of a numpy ``.npz`` (read without pickle) -> the two datasets."""
    regular_file(source, f"npz file {source}", DataError)
    try:
        with open(source, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise DataError(f"{source}: cannot read it ({shown(e)})") from None
    if head[:2] != b"PK":  # else numpy reads any other file as a pickle, and refuses it as one
        raise DataError(f"{source}: not an .npz file (a zip archive of .npy arrays, as numpy.savez writes); it "
                        f"starts with {head!r}")
    try:
        with np.load(source, allow_pickle=False) as z:
            missing = [n for n in (inputs, targets) if n not in z.files]
            if missing:
                raise DataError(f"{source}: no array {missing[0]!r} (arrays: {', '.join(z.files) or 'none'})")
            x, y = z[inputs], z[targets]
    except DataError:
        raise
    except (OSError, ValueError, EOFError, KeyError, RuntimeError, NotImplementedError, MemoryError,
            zipfile.BadZipFile, zlib.error, struct.error) as e:
        # not a zip, a damaged or truncated one (a bad CRC, a corrupt deflate stream, an unknown compression),
        # a member declaring more than memory holds, an object array (needs pickle)
        raise DataError(f"{source}: cannot read it as an .npz of numeric arrays: "
                        f"{type(e).__name__}: {' '.join(shown(e).split())}") from None
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if x.ndim > 2:
        x = x.reshape(len(x), -1)
    inputs_, targets_ = _write_table(path, x, y, regression, source=source)
    return _table_summary(path, inputs_, targets_)


def bin_to_h5(source: str, path: str, *, vocab_from: str = "") -> str:
    """nanoGPT's ``train.bin``/``val.bin`` (little-endian uint16 ids) -> the token dataset, with the character
    vocabulary of the text ``vocab_from`` when given."""
    import os

    regular_file(source, f"token file {source}", DataError)
    size = os.path.getsize(source)
    if size == 0 or size % 2:
        raise DataError(f"{source}: {size} bytes is not a whole number of uint16 token ids (nanoGPT's .bin)")
    try:
        ids = np.memmap(source, dtype="<u2", mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"{source}: cannot read uint16 token ids: {shown(e)}") from None
    top = int(ids.max())
    vocab = None
    if vocab_from:
        raw = read_capped(vocab_from, f"text file {vocab_from}", DataError, MAX_BYTES)
        try:
            vocab = CharTokenizer.from_text(raw.decode("utf-8")).vocabulary
        except UnicodeDecodeError as e:
            raise DataError(f"cannot read {vocab_from} as UTF-8 text: {e}") from None
        if top >= len(vocab):
            raise DataError(f"{source}: token id {top} is outside the {len(vocab)}-character vocabulary of "
                            f"{vocab_from}: not the text this .bin was made from")
    with replaced_atomically(path, f"cannot write {path}", DataError) as tmp, \
            h5_output(tmp, f"cannot write {path}", DataError) as f:
        dset = f.create_dataset(TOKENS, shape=ids.shape, dtype=np.uint16, chunks=True)
        step = 1 << 24
        for lo in range(0, len(ids), step):
            dset[lo : lo + step] = ids[lo : lo + step]
        if vocab is not None:
            dset.attrs["vocabulary"] = np.array([ord(ch) for ch in vocab], dtype=np.int32)
    del ids
    what = f"{len(vocab)} characters in the vocabulary" if vocab is not None else \
        "no vocabulary (hpctrain sample cannot decode it; GPT-2 ids need model.vocab_size >= 50257)"
    return (f"{path}: {size // 2:,} tokens, ids up to {top}, {what} (dataset 'tokens'; use data.tokens = "
            f"\"tokens\" and model.vocab_size >= {top + 1})")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _table_summary(path, inputs, targets) -> str:
    kind = (f"{int(targets.max()) + 1} classes (int64 labels)" if targets.dtype == np.int64
            else f"{1 if targets.ndim == 1 else targets.shape[1]} float target(s)")
    return (f"{path}: {len(inputs):,} samples, {inputs.shape[1]} input features, {kind} (datasets 'inputs' and "
            "'targets'; use data.inputs = \"inputs\" and data.targets = \"targets\")")
