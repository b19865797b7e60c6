"""Subword (BPE) tokens through tiktoken: GPT-2's, cl100k_base, or a local ranks file.

    hpctrain data text2h5 input.txt train.h5 --tokenizer gpt2              # fetched once, cached by tiktoken
    hpctrain data text2h5 input.txt train.h5 --tokenizer ./gpt2.tiktoken   # offline: a ranks file

A tokenizer is named by tiktoken's encoding name (``gpt2``, ``r50k_base``, ``p50k_base``, ``cl100k_base``,
``o200k_base``), whose ranks tiktoken fetches on first use and keeps under ``TIKTOKEN_CACHE_DIR``, or by the
path of a ranks file (``*.tiktoken``: a base64 token and its rank a line). A ranks file named after an encoding
(``gpt2.tiktoken``, ``cl100k_base.tiktoken``) takes that encoding's split pattern and special tokens; any other
name takes GPT-2's pattern and one ``<|endoftext|>`` after its ranks.

The token dataset keeps what decodes it, as attributes: ``tokenizer`` (the name), ``tokenizer_sha256`` (SHA-256
of the ranks written as a ``.tiktoken`` file in rank order: ``sha256sum`` of the file tiktoken publishes),
``n_vocab`` (the ids it can produce: ``model.vocab_size`` when the config leaves it out) and, for a ranks file,
``tokenizer_file`` (its absolute path). Checkpoints keep the first three (root attribute ``tokenizer``, JSON),
so ``hpctrain sample`` decodes with the very ranks the model was trained on, and refuses others.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os

import numpy as np

from .errors import DataError

__all__ = ["Bpe", "load_bpe", "bpe_attrs", "attach", "read_attrs", "bpe_from_attrs", "ranks_sha256"]

ATTRS = ("tokenizer", "tokenizer_sha256", "n_vocab", "tokenizer_file")


def _tiktoken():
    try:
        import tiktoken
        import tiktoken.load  # noqa: F401
        import tiktoken_ext.openai_public as public
    except ImportError:
        raise DataError("subword tokens need tiktoken: pip install 'hpctrain[tokens]'") from None
    return tiktoken, public


def ranks_sha256(ranks: dict) -> str:
    """SHA-256 of ``ranks`` written as a ``.tiktoken`` file (``base64(token) rank`` lines in rank order)."""
    h = hashlib.sha256()
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return h.hexdigest()


class Bpe:
    """A tiktoken encoding with its name, the SHA-256 of its ranks and, for a ranks file, its path."""

    def __init__(self, name: str, ranks: dict, pat_str: str, special_tokens: dict, n_vocab: int | None = None,
                 path: str = ""):
        tiktoken, _ = _tiktoken()
        self.name, self.path, self.sha256 = name, path, ranks_sha256(ranks)
        self.encoding = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks,
                                          special_tokens=special_tokens, explicit_n_vocab=n_vocab)
        self.n_vocab = self.encoding.n_vocab

    def __len__(self) -> int:
        return self.n_vocab

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``; special tokens are ordinary text here (``<|endoftext|>`` in a file is not one)."""
        return np.asarray(self.encoding.encode_ordinary(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def description(self) -> str:
        """What a checkpoint keeps (JSON): name, sha256, n_vocab."""
        return json.dumps({"name": self.name, "sha256": self.sha256, "n_vocab": self.n_vocab}, sort_keys=True)


def _known(public, name: str, ranks: dict | None):
    """The constructor's dict of encoding ``name`` (ranks fetched by tiktoken), or, with ``ranks`` given, its
    pattern and special tokens around those ranks (nothing fetched)."""
    make = public.ENCODING_CONSTRUCTORS[name]
    if ranks is None:
        return make()
    saved = public.load_tiktoken_bpe, public.data_gym_to_mergeable_bpe_ranks
    public.load_tiktoken_bpe = public.data_gym_to_mergeable_bpe_ranks = lambda *a, **k: ranks
    try:
        return make()
    finally:
        public.load_tiktoken_bpe, public.data_gym_to_mergeable_bpe_ranks = saved


def load_bpe(spec: str) -> Bpe:
    """The tokenizer ``spec`` names: an encoding name, or the path of a ranks file. One-line DataError when tiktoken
    is missing, the ranks cannot be fetched (no network) or the file cannot be read."""
    tiktoken, public = _tiktoken()
    looks_like_path = os.sep in spec or spec.endswith(".tiktoken") or os.path.exists(spec)
    if not looks_like_path:
        if spec not in public.ENCODING_CONSTRUCTORS:
            raise DataError(f"--tokenizer {spec!r}: not an encoding tiktoken knows (known: "
                            f"{', '.join(sorted(public.ENCODING_CONSTRUCTORS))}) nor a ranks file (PATH.tiktoken)")
        try:
            d = _known(public, spec, None)
        except Exception as e:  # requests' and urllib's errors, a hash mismatch, a read-only cache
            raise DataError(f"cannot fetch the ranks of tokenizer {spec!r} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); without internet, copy its ranks file "
                            f"(tiktoken's {spec}.tiktoken) here and pass --tokenizer PATH/{spec}.tiktoken, or point "
                            "TIKTOKEN_CACHE_DIR at a cache that holds it") from None
        return Bpe(spec, d["mergeable_ranks"], d["pat_str"], d["special_tokens"], d.get("explicit_n_vocab"))
    path = os.path.abspath(spec)
    if not os.path.isfile(path):
        raise DataError(f"--tokenizer {spec}: no such ranks file" if not os.path.exists(path) else
                        f"--tokenizer {spec}: not a regular file")
    try:
        with open(path, "rb") as f:
            ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in f if line)}
    except (OSError, ValueError) as e:
        raise DataError(f"--tokenizer {spec}: not a ranks file (base64 token and rank a line): "
                        f"{type(e).__name__}: {e}") from None
    if not ranks:
        raise DataError(f"--tokenizer {spec}: the ranks file is empty")
    name = os.path.basename(path)[: -len(".tiktoken")] if path.endswith(".tiktoken") else os.path.basename(path)
    if name in public.ENCODING_CONSTRUCTORS:
        d = _known(public, name, ranks)
        return Bpe(name, ranks, d["pat_str"], d["special_tokens"], d.get("explicit_n_vocab"), path=path)
    top = max(ranks.values())
    return Bpe(name, ranks, public.r50k_pat_str, {"<|endoftext|>": top + 1}, path=path)


def attach(dset, bpe: Bpe) -> None:
    """Write ``bpe``'s attributes on the token dataset ``dset`` (an open h5py dataset)."""
    for key in ATTRS:
        if key in dset.attrs:
            del dset.attrs[key]
    if "vocabulary" in dset.attrs:  # character tokens no longer
        del dset.attrs["vocabulary"]
    dset.attrs["tokenizer"] = bpe.name
    dset.attrs["tokenizer_sha256"] = bpe.sha256
    dset.attrs["n_vocab"] = np.int64(bpe.n_vocab)
    if bpe.path:
        dset.attrs["tokenizer_file"] = bpe.path


def write_bpe_tokens(path: str, ids: np.ndarray, bpe: Bpe) -> None:
    """Write ``ids`` as the token file ``path`` (dataset ``tokens``, uint16 where the ids fit, else uint32) with
    ``bpe``'s attributes; atomically (a temporary file renamed into place)."""
    import h5py

    from ._files import replaced_atomically

    dtype = np.uint16 if bpe.n_vocab <= 1 << 16 else np.uint32
    label = f"cannot write the token file {path}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as e:
        raise DataError(f"{label}: {e.strerror or e}") from None
    with replaced_atomically(path, label, DataError) as tmp, h5py.File(tmp, "w") as f:
        attach(f.create_dataset("tokens", data=np.asarray(ids).astype(dtype), chunks=True), bpe)


def attach_to_file(path: str, bpe: Bpe, dataset: str = "tokens") -> str:
    """``attach`` ``bpe`` to the token dataset of the file ``path`` (bin2h5 --tokenizer); DataError when an id is
    outside its ``n_vocab``. Returns the line bin2h5 prints."""
    import h5py

    with h5py.File(path, "a", locking=False) as f:
        dset = f[dataset]
        top, step = -1, 1 << 24
        for lo in range(0, dset.shape[0], step):
            top = max(top, int(dset[lo : lo + step].max()))
        if top >= bpe.n_vocab:
            raise DataError(f"{path}: token id {top} is outside the {bpe.n_vocab} ids of tokenizer {bpe.name}: not "
                            "the tokenizer these ids were made with")
        attach(dset, bpe)
        count = dset.shape[0]
    return (f"{path}: {count:,} tokens of {bpe.name}, ids up to {top} (dataset 'tokens'; use data.tokens = "
            f"\"tokens\"; model.vocab_size is read from it: {bpe.n_vocab})")


def bpe_attrs(attrs) -> dict | None:
    """The tokenizer attributes of a token dataset's ``attrs`` as a dict, None without ``tokenizer``."""
    if "tokenizer" not in attrs:
        return None

    def text(v):
        return v.decode() if isinstance(v, bytes) else str(v)

    out = {"name": text(attrs["tokenizer"]), "sha256": text(attrs.get("tokenizer_sha256", "")),
           "n_vocab": int(attrs.get("n_vocab", 0))}
    if "tokenizer_file" in attrs:
        out["file"] = text(attrs["tokenizer_file"])
    return out


def read_attrs(path: str, dataset: str) -> dict | None:
    """``bpe_attrs`` of ``dataset`` in the token file ``path`` (None: no tokenizer, or no such dataset)."""
    import h5py

    from ._files import H5_ERRORS, regular_file, shown

    regular_file(path, f"token file {path}", DataError)
    try:
        with h5py.File(path, "r", locking=False) as f:
            obj = f.get(dataset)
            return bpe_attrs(obj.attrs) if isinstance(obj, h5py.Dataset) else None
    except H5_ERRORS as e:
        raise DataError(f"{path}: cannot read the tokenizer attributes: {shown(e)}") from None


def bpe_from_attrs(info: dict, override: str = "", where: str = "") -> Bpe:
    """The tokenizer ``info`` describes (``bpe_attrs`` or a checkpoint's JSON), loaded from ``override`` (a name or
    ranks file) when given, else from the ranks file it names when that exists, else by its name through
    tiktoken; DataError when the ranks found are not the ones it was made with (their SHA-256)."""
    spec = override or (info.get("file") if info.get("file") and os.path.isfile(info["file"]) else info["name"])
    bpe = load_bpe(spec)
    if info.get("sha256") and bpe.sha256 != info["sha256"]:
        raise DataError(f"tokenizer {spec}: its ranks (sha256 {bpe.sha256[:12]}…) are not the ones "
                        f"{where or 'the data'} was tokenized with ({info['name']}, sha256 {info['sha256'][:12]}…): its "
                        "ids would mean other tokens")
    return bpe
