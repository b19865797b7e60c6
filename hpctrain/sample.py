"""Text from a trained GPT: ``hpctrain sample CHECKPOINT --prompt TEXT --tokens N``.

    hpctrain sample runs/gpt-char/ckpt-00001500.h5 --prompt "The " --tokens 300 --temperature 0.8 --top-k 20

The checkpoint's own config names the model, and the checkpoint holds the vocabulary its
data had (a checkpoint without one decodes with the vocabulary of the token file its
config names, or ``--vocab FILE``). One process, on ``--backend`` (``auto``: a GPU when
there is one, else the CPU). The prompt (its last ``block_size`` tokens) runs through the model
once, left-aligned in a full window (attention is causal, so the positions after the text change
nothing before it), and each block's keys and values are kept; every new token then costs one
position: its row through each block, attending over the cache (nn/decode.py). Past ``block_size``
tokens the window slides: the last ``block_size`` tokens run through again. ``--no-cache`` runs the
whole window for every token instead (the same tokens for the same seed, slower). As nanoGPT's
``generate``: logits of the last position divided by the temperature, cropped to the ``top_k``
largest, softmax, one draw (``--temperature 0``: the most likely token).
"""

from __future__ import annotations

import math
import tomllib

import numpy as np

from . import checkpoint as ckpt
from .errors import CheckpointError, ConfigError, DataError

__all__ = ["Generator", "sample"]


class Generator:
    """A GPT's parameters on a backend, and next-token draws from it."""

    def __init__(self, spec, params: dict, backend):
        from .params import FlatBuffer

        self.spec, self.be = spec, backend
        self.part = spec.part()
        self.params, grads = FlatBuffer(backend, self.part.layout), FlatBuffer(backend, self.part.layout)
        self.part.bind(self.params, grads)
        self.params.load_host_dict(params)

    def logits(self, ids) -> np.ndarray:
        """Next-token logits (float64) after the token ids ``ids`` (at least one; the last block_size count)."""
        T = self.spec.block_size
        context = np.asarray(ids, dtype=np.int64)[-T:]
        window = np.zeros((1, T), dtype=np.int64)
        window[0, : len(context)] = context
        out, _ = self.part.forward(self.be, self.be.asarray(window))
        return self.be.to_host(out)[len(context) - 1].astype(np.float64)

    def generate(self, ids, n: int, *, temperature: float, top_k: int, rng, vocab: int = 0,
                 cache: bool = True) -> list[int]:
        """``ids`` and ``n`` more; only ids below ``vocab`` are drawn when given (a padded table's
        extra rows are no characters). ``cache``: with a key/value cache (nn/decode.py), else the whole
        window through the model for every token; the same logits up to float32 rounding either way."""
        ids = list(ids)
        decoder = None
        if cache and n:
            from .nn.decode import CachedDecoder

            decoder = CachedDecoder(self.part, self.be)
        for i in range(n):
            if decoder is None:
                z = self.logits(ids)
            elif i == 0 or decoder.full:  # the prompt, or the window slid past block_size
                z = decoder.prefill(ids)
            else:
                z = decoder.step(ids[-1])
            if vocab:
                z = z[:vocab]
            if temperature == 0:
                ids.append(int(np.argmax(z)))
                continue
            z = (z - z.max()) / temperature  # shifted first: a tiny temperature cannot overflow
            if top_k and top_k < len(z):
                z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
            p = np.exp(z)
            ids.append(int(rng.choice(len(p), p=p / p.sum())))
        return ids


def sample(path: str, prompt: str, n: int, *, temperature=1.0, top_k=0, seed=0, vocab="", backend="auto",
           cache=True, tokens_only=False, tokenizer="") -> str:
    """The prompt and ``n`` generated characters from the GPT checkpoint ``path``; ``tokens_only``: their token
    ids instead, separated by spaces; ``cache = False``: without the key/value cache (``--no-cache``)."""
    from .backend import get_backend
    from .config import parse_config
    from .nn.gpt import GPTSpec

    if n < 0:
        raise ConfigError(f"--tokens must be >= 0, got {n}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 = all), got {top_k}")
    try:
        meta = ckpt.read_meta(path)
    except CheckpointError as e:
        if "weights-only" in str(e):  # the model is defined by the config a checkpoint carries
            raise CheckpointError(f"{path} is a weights-only file: sample needs a checkpoint (ckpt-*.h5), whose "
                                  "config defines the model") from None
        raise
    try:
        cfg = parse_config(tomllib.loads(meta.config_text), source=f"{path} (its config)")
    except tomllib.TOMLDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: its config attribute is not TOML: {e}") from None
    if cfg.model.kind != "gpt":
        raise ConfigError(f"checkpoint {path} holds a {cfg.model.kind} model; sample needs a GPT (model.kind = \"gpt\")")
    spec = GPTSpec.from_config(cfg.model)
    tokenizer = _tokenizer(meta, cfg, vocab, tokenizer)
    if not prompt:
        raise ConfigError("--prompt must hold at least one character")
    ids = tokenizer.encode(prompt)
    weights = ckpt.load_weights(path, spec.layout)
    gen = Generator(spec, weights, get_backend(backend))
    if len(tokenizer) > spec.vocab_size:
        raise DataError(f"the vocabulary has {len(tokenizer)} tokens but the model only {spec.vocab_size} ids")
    out = gen.generate(ids, n, temperature=temperature, top_k=top_k, rng=np.random.default_rng(seed),
                       vocab=len(tokenizer), cache=cache)
    return " ".join(map(str, out)) if tokens_only else tokenizer.decode(out)


def _tokenizer(meta, cfg, vocab: str, ranks: str = ""):
    """The checkpoint's vocabulary; else the token file's (``--vocab``, or the config's data), said clearly. Subword
    tokens (hpctrain/tokens.py): the tokenizer the checkpoint (else the token file) names, its ranks from
    ``ranks`` (``--tokenizer``: a name or ranks file), the ranks file the token file names, or tiktoken's cache,
    checked against the SHA-256 the model was trained with."""
    import json

    from .text import CharTokenizer, read_vocabulary
    from .tokens import bpe_from_attrs, read_attrs

    info = json.loads(meta.tokenizer) if meta.tokenizer else None
    if not meta.vocabulary:
        source = vocab or cfg.data.path
        try:
            stored = read_attrs(source, cfg.data.tokens if not vocab else "tokens")
        except DataError:
            stored = None  # no file: the checkpoint's own description, if any, still decodes
        if info is None:
            info = stored
        elif stored is not None and stored["sha256"] != info["sha256"]:
            raise DataError(f"{source}: tokenized with {stored['name']} (sha256 {stored['sha256'][:12]}…), not with "
                            f"the checkpoint's {info['name']} (sha256 {info['sha256'][:12]}…)")
        elif stored is not None:
            info = {**info, **{k: v for k, v in stored.items() if k == "file"}}
    if info is not None:
        return bpe_from_attrs(info, ranks, where=meta.path or "the checkpoint")
    if ranks:
        raise DataError(f"--tokenizer {ranks}: the checkpoint was trained on character tokens (or says nothing of "
                        "a tokenizer); leave --tokenizer out")

    stored = CharTokenizer(meta.vocabulary) if meta.vocabulary else None
    if stored is not None and not vocab:
        return stored
    source = vocab or cfg.data.path
    try:
        tok = read_vocabulary(source, cfg.data.tokens if not vocab else "tokens")
    except DataError as e:
        hint = "" if vocab else " (the token file the checkpoint's config names; pass another with --vocab)"
        raise DataError(f"{e}{hint}") from None
    if tok is None:
        raise DataError(f"{source}: no vocabulary attribute to decode with; name a token file written by "
                        "`hpctrain data text2h5` with --vocab")
    if stored is not None and tok.vocabulary != stored.vocabulary:
        if len(tok) == len(stored):  # the same size: say where they part
            i = next(i for i, (a, b) in enumerate(zip(tok.vocabulary, stored.vocabulary)) if a != b)
            how = (f"both {len(tok)} characters, but id {i} is {tok.vocabulary[i]!r} there and "
                   f"{stored.vocabulary[i]!r} in the checkpoint's")
        else:
            how = f"{len(tok)} characters against the checkpoint's {len(stored)}"
        raise DataError(f"--vocab {vocab}: its vocabulary is not the one the checkpoint was trained with ({how}); "
                        "leave --vocab out to use the checkpoint's")
    return tok
