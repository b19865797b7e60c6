"""Text to token datasets: a character-level tokenizer and the bundled corpus.

A token file is an HDF5 file with one 1-D integer dataset, ``tokens``, whose
``vocabulary`` attribute lists the Unicode code points of the characters in id order
(id i is ``chr(vocabulary[i])``), so ``hpctrain sample`` can decode what a model trained
on it writes. Like nanoGPT's shakespeare_char, the vocabulary is the sorted set of the
characters in the text.

    hpctrain data text2h5 INPUT.txt OUT.h5
    write_corpus("pydoc", "runs/pydoc.h5")   # the English text of Python's documentation

The bundled corpus is ``pydoc_data.topics``: the help text every Python install carries
(about 465,000 characters), so training a character-level GPT needs no download.
"""

from __future__ import annotations

import os

import h5py
import numpy as np

from ._files import H5_ERRORS, h5_output, member, regular_file, replaced_atomically, shown
from .errors import ConfigError, DataError

__all__ = ["CharTokenizer", "corpus_text", "write_tokens", "text_to_h5", "write_corpus", "read_vocabulary"]

CORPORA = ("pydoc",)
TOKENS = "tokens"


class CharTokenizer:
    """Characters <-> ids; ``encode`` refuses a character outside the vocabulary, naming it."""

    def __init__(self, vocabulary: str):
        if len(set(vocabulary)) != len(vocabulary):
            raise DataError("the vocabulary repeats a character")
        self.vocabulary = vocabulary
        self._ids = {ch: i for i, ch in enumerate(vocabulary)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.vocabulary)

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.fromiter((self._ids[ch] for ch in text), dtype=np.int64, count=len(text))
        except KeyError as e:
            ch = e.args[0]
            raise DataError(f"character {ch!r} (U+{ord(ch):04X}) at position {text.index(ch)} is not in the "
                            f"vocabulary of {len(self)} characters") from None

    def decode(self, ids) -> str:
        return "".join(self.vocabulary[int(i)] for i in ids)


def corpus_text(name: str) -> str:
    """The text of a bundled corpus."""
    if name != "pydoc":
        raise ConfigError(f"data.corpus: unknown corpus {name!r} (known: {', '.join(CORPORA)})")
    from pydoc_data import topics

    return "\n".join(topics.topics[key] for key in sorted(topics.topics))


def write_tokens(path: str, ids: np.ndarray, vocabulary: str) -> None:
    """Write ``ids`` and the vocabulary as a token file; atomically (a temporary file renamed into place)."""
    dtype = np.uint16 if len(vocabulary) <= 1 << 16 else np.int32
    label = f"cannot write the token file {path}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as e:
        raise DataError(f"{label}: {e.strerror or e}") from None
    with replaced_atomically(path, label, DataError) as tmp, h5_output(tmp, label, DataError) as f:
        dset = f.create_dataset(TOKENS, data=np.asarray(ids).astype(dtype), chunks=True)
        dset.attrs["vocabulary"] = np.array([ord(ch) for ch in vocabulary], dtype=np.int32)


def text_to_h5(text: str, path: str) -> CharTokenizer:
    """Tokenise ``text`` character by character into the token file ``path``; returns the tokenizer."""
    if not text:
        raise DataError("the text is empty")
    tok = CharTokenizer.from_text(text)
    write_tokens(path, tok.encode(text), tok.vocabulary)
    return tok


def write_corpus(name: str, path: str) -> CharTokenizer:
    return text_to_h5(corpus_text(name), path)


def read_vocabulary(path: str, dataset: str = TOKENS, *, allow_external: bool = False) -> CharTokenizer | None:
    """The tokenizer stored with a token dataset, None when it has no ``vocabulary`` attribute.

    ``allow_external``: follow an external link to the dataset (``data.allow_external``).
    """
    regular_file(path, f"token file {path}", DataError)  # never open a FIFO or a device
    try:
        with h5py.File(path, "r", locking=False) as f:
            obj, problem = member(f, dataset, allow_external=allow_external)
            if problem:
                raise DataError(f"{path}: dataset {dataset!r} {problem}")
            if not isinstance(obj, h5py.Dataset) or "vocabulary" not in obj.attrs:
                return None
            points = np.asarray(obj.attrs["vocabulary"])
    except H5_ERRORS as e:
        raise DataError(f"{path}: cannot read the vocabulary: {shown(e)}") from None
    if points.ndim != 1 or not np.issubdtype(points.dtype, np.integer) or \
            (points.size and (points.min() < 0 or points.max() > 0x10FFFF)):
        raise DataError(f"{path}: dataset {dataset!r} has a vocabulary attribute that is not a list of code points")
    try:
        return CharTokenizer("".join(map(chr, points.tolist())))
    except DataError as e:
        raise DataError(f"{path}: dataset {dataset!r}: {e}") from None
