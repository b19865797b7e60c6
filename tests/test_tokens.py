"""Subword tokens (hpctrain/tokens.py): text2h5 --tokenizer with a ranks file the test writes (no network),
what the token file and the checkpoint keep, sample decoding with the same ranks and refusing others,
bin2h5 --tokenizer, and the one-line messages."""

import base64
import json

import h5py
import numpy as np
import pytest

pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install 'hpctrain[tokens]')")

from hpctrain.errors import DataError  # noqa: E402
from hpctrain.tokens import load_bpe, ranks_sha256  # noqa: E402
from test_cli import hpctrain  # noqa: E402

TEXT = "the cat ate the hat. " * 40 + "a bat and the cat.\n" * 20


def write_ranks(path, merges=(b"th", b"the", b" the", b"at", b" c", b" cat", b" h", b" hat")):
    """A small ranks file: the 256 bytes, then merges (each of two tokens already ranked)."""
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    path.write_bytes(b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n" for r, t in enumerate(tokens)))
    return str(path)


def test_a_ranks_file_encodes_and_decodes_offline(tmp_path):
    bpe = load_bpe(write_ranks(tmp_path / "tiny.tiktoken"))
    ids = bpe.encode(TEXT)
    assert bpe.decode(ids) == TEXT
    assert len(ids) < len(TEXT) * 0.6 and ids.max() >= 256  # the merges are used
    assert bpe.n_vocab == 256 + 8 + 1  # the ranks and <|endoftext|>
    assert bpe.name == "tiny" and bpe.path == str(tmp_path / "tiny.tiktoken")
    import hashlib
    assert bpe.sha256 == hashlib.sha256((tmp_path / "tiny.tiktoken").read_bytes()).hexdigest()  # sha256sum's
    assert ranks_sha256({b"a": 0}) == hashlib.sha256(base64.b64encode(b"a") + b" 0\n").hexdigest()


def test_one_line_messages(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="no such ranks file"):
        load_bpe(str(tmp_path / "missing.tiktoken"))
    (tmp_path / "bad.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(DataError, match=r"not a ranks file \(base64 token and rank a line\)"):
        load_bpe(str(tmp_path / "bad.tiktoken"))
    with pytest.raises(DataError, match="'gpt5': not an encoding tiktoken knows"):
        load_bpe("gpt5")
    import tiktoken_ext.openai_public as public

    def offline(*a, **k):
        raise ConnectionError("Failed to resolve host\nmore detail")
    monkeypatch.setattr(public, "load_tiktoken_bpe", offline)
    with pytest.raises(DataError) as e:
        load_bpe("cl100k_base")
    assert "cannot fetch the ranks of tokenizer 'cl100k_base' (ConnectionError: Failed to resolve host)" in \
        str(e.value) and "--tokenizer PATH/cl100k_base.tiktoken" in str(e.value) and "\n" not in str(e.value)


def test_a_ranks_file_named_after_an_encoding_takes_its_pattern_and_special_tokens(tmp_path):
    ranks = write_ranks(tmp_path / "cl100k_base.tiktoken")
    bpe = load_bpe(ranks)  # nothing fetched: tiktoken's constructor gets these ranks
    assert bpe.name == "cl100k_base" and "<|endoftext|>" in bpe.encoding.special_tokens_set
    assert bpe.decode(bpe.encode(TEXT)) == TEXT


def _gpt_job(tmp_path, data="t.h5"):
    (tmp_path / "gpt.toml").write_text(f"""
[model]
kind = "gpt"
block_size = 8
n_layer = 1
n_head = 2
n_embd = 8
[data]
path = "{data}"
tokens = "tokens"
[train]
batch_size = 8
steps = 2
backend = "cpu"
eval_every = 0
[checkpoint]
dir = "ck"
""")
    return str(tmp_path / "gpt.toml")


def test_text_to_samples_with_subword_tokens(tmp_path):
    ranks = write_ranks(tmp_path / "tiny.tiktoken")
    (tmp_path / "in.txt").write_text(TEXT)
    r = hpctrain("data", "text2h5", str(tmp_path / "in.txt"), str(tmp_path / "t.h5"), "--tokenizer", ranks)
    assert r.returncode == 0, r.stderr
    assert "tokens of tiny" in r.stdout and "265" in r.stdout
    with h5py.File(tmp_path / "t.h5", "r", locking=False) as f:
        a = f["tokens"].attrs
        assert (a["tokenizer"], int(a["n_vocab"]), a["tokenizer_file"]) == ("tiny", 265, ranks)
        assert a["tokenizer_sha256"] == load_bpe(ranks).sha256 and "vocabulary" not in a
        assert load_bpe(ranks).decode(f["tokens"][:]) == TEXT
    cfg = _gpt_job(tmp_path)
    r = hpctrain("train", cfg)
    assert r.returncode == 0, r.stderr
    ck = str(tmp_path / "ck" / "ckpt-00000002.h5")
    r = hpctrain("inspect", ck)
    with h5py.File(ck, "r", locking=False) as f:
        kept = json.loads(f.attrs["tokenizer"])
        assert kept == {"name": "tiny", "sha256": load_bpe(ranks).sha256, "n_vocab": 265}
        assert f["params/transformer.wte.weight"].shape[0] == 265  # model.vocab_size from the token file
    r = hpctrain("sample", ck, "--prompt", "the cat", "--tokens", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the cat")
    r = hpctrain("sample", ck, "--prompt", "the cat", "--tokens", "5", "--tokens-only")
    ids = [int(i) for i in r.stdout.split()]
    k = len(load_bpe(ranks).encode("the cat"))
    assert k == 2 and load_bpe(ranks).decode(ids[:k]) == "the cat" and len(ids) == k + 5  # "the", " cat"
    # the ranks file moved, the token file gone: --tokenizer names it; other ranks are refused
    (tmp_path / "t.h5").unlink()
    moved = tmp_path / "elsewhere.tiktoken"
    (tmp_path / "tiny.tiktoken").rename(moved)
    r = hpctrain("sample", ck, "--prompt", "the", "--tokens", "3", "--tokenizer", str(moved))
    assert r.returncode == 0, r.stderr
    other = write_ranks(tmp_path / "other.tiktoken", merges=(b"ca", b"cat"))
    r = hpctrain("sample", ck, "--prompt", "the", "--tokens", "3", "--tokenizer", other)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "are not the ones" in r.stderr and "its ids would mean other tokens" in r.stderr


def test_bin2h5_attaches_a_tokenizer_and_predict_refuses_other_tokens(tmp_path):
    ranks = write_ranks(tmp_path / "tiny.tiktoken")
    ids = load_bpe(ranks).encode(TEXT).astype("<u2")
    ids.tofile(tmp_path / "train.bin")
    r = hpctrain("data", "bin2h5", str(tmp_path / "train.bin"), str(tmp_path / "t.h5"), "--tokenizer", ranks)
    assert r.returncode == 0, r.stderr
    assert "tokens of tiny" in r.stdout
    with h5py.File(tmp_path / "t.h5", "r", locking=False) as f:
        assert f["tokens"].attrs["tokenizer"] == "tiny"
    small = write_ranks(tmp_path / "small.tiktoken", merges=())
    r = hpctrain("data", "bin2h5", str(tmp_path / "train.bin"), str(tmp_path / "u.h5"), "--tokenizer", small)
    assert r.returncode == 2 and "is outside the 257 ids of tokenizer small" in r.stderr
    assert not (tmp_path / "u.h5").exists()
    # a checkpoint of subword tokens against a character token file: predict and eval refuse it
    cfg = _gpt_job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000002.h5")
    from hpctrain.text import text_to_h5
    text_to_h5(TEXT, str(tmp_path / "chars.h5"))
    r = hpctrain("predict", ck, "--data", str(tmp_path / "chars.h5"), "--out", str(tmp_path / "p.h5"))
    assert r.returncode == 2 and "one holds character ids, the other subword ids" in r.stderr, r.stderr
    r = hpctrain("eval", ck, "--data", str(tmp_path / "chars.h5"))
    assert r.returncode == 2 and "one holds character ids, the other subword ids" in r.stderr, r.stderr


def test_the_gpt2_walkthrough_in_the_docs_runs_as_written(tmp_path):
    """docs/gpt.md's "From text to samples with GPT-2 tokens", line by line in a scratch copy of the repository's
    jobs/configs, with the one change a machine without internet makes: a ranks file for --tokenizer gpt2."""
    import os
    import re
    import shutil
    import subprocess
    import sys

    from test_cli import ROOT

    text = open(os.path.join(ROOT, "docs", "gpt.md")).read()
    section = text.split("## From text to samples with GPT-2 tokens", 1)[1]
    block = re.search(r"^```\n(.*?)^```", section, re.S | re.M).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert any("--tokenizer gpt2" in line for line in lines) and lines[-1].startswith("hpctrain sample")
    shutil.copytree(os.path.join(ROOT, "jobs", "configs"), tmp_path / "jobs" / "configs")
    ranks = write_ranks(tmp_path / "tiny.tiktoken")
    env = {**os.environ, "PYTHONPATH": ROOT}
    for line in lines:
        line = line.replace("--tokenizer gpt2", f"--tokenizer {ranks}")
        line = re.sub(r"^hpctrain ", f"{sys.executable} -m hpctrain ", line)
        line = re.sub(r"^python ", f"{sys.executable} ", line)
        r = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{line}: {r.stderr[-2000:]}"
    assert r.stdout.startswith("The ") and len(r.stdout) > 20  # the sample's text, decoded
