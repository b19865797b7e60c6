"""The GPT's data and tools: character tokens, token windows, the bundled corpus, bad input (one line,
exit 2), sampling from a checkpoint, and a short run that learns."""

import math
import os

import h5py
import numpy as np
import pytest

from helpers import gpt_config, make_tokens
from hpctrain.data import TokenDataset
from hpctrain.errors import ConfigError, DataError
from hpctrain.text import CharTokenizer, corpus_text, read_vocabulary
from test_cli import hpctrain


def test_char_tokenizer_round_trip_and_unknown_characters():
    tok = CharTokenizer.from_text("hello world")
    assert tok.vocabulary == " dehlorw"
    assert tok.decode(tok.encode("world hello")) == "world hello"
    with pytest.raises(DataError, match=r"character 'z' \(U\+007A\) at position 3 is not in the vocabulary of 8"):
        tok.encode("helz")


def test_text2h5_writes_tokens_and_their_vocabulary(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("naïve café\nnaïve", encoding="utf-8")
    r = hpctrain("data", "text2h5", str(src), str(tmp_path / "t.h5"))
    assert r.returncode == 0, r.stderr
    assert "16 tokens, 10 characters" in r.stdout
    tok = read_vocabulary(str(tmp_path / "t.h5"))
    with h5py.File(tmp_path / "t.h5") as f:
        assert tok.decode(f["tokens"][:]) == "naïve café\nnaïve"
        assert f["tokens"].dtype == np.uint16
    r = hpctrain("data", "text2h5", str(tmp_path / "missing.txt"), str(tmp_path / "u.h5"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "text file" in r.stderr and "does not exist" in r.stderr
    os.mkfifo(tmp_path / "pipe")  # read, it would block for ever
    r = hpctrain("data", "text2h5", str(tmp_path / "pipe"), str(tmp_path / "u.h5"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is a FIFO (named pipe), not a regular file" in r.stderr


def test_windows_are_block_size_plus_one_tokens(tmp_path):
    ids = np.arange(23) % 7
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["tokens"] = ids
    d = TokenDataset(str(tmp_path / "t.h5"), "tokens", block_size=4, val_fraction=0.2, vocab_size=7)
    assert (d.n_train, d.n_val) == (5 - 1, 1)  # (23 - 1) // 4 = 5 windows
    x, y = d.read(np.array([3, 0, 1, 4]))  # any order; 0 and 1 are one read
    for row, i in enumerate([3, 0, 1, 4]):
        np.testing.assert_array_equal(x[row], ids[4 * i : 4 * i + 4])
        np.testing.assert_array_equal(y[4 * row : 4 * row + 4], ids[4 * i + 1 : 4 * i + 5])
    assert x.dtype == y.dtype == np.int64 and y.shape == (16,)
    assert d.scan(0, 5) == ""
    d.close()


def test_token_data_bad_input(tmp_path):
    path = str(tmp_path / "t.h5")
    with h5py.File(path, "w") as f:
        f["short"] = np.arange(4)
        f["bad"] = np.array([0, 1, 2, 9, 1, 0, 1, 2, 3])
        f["matrix"] = np.zeros((3, 3), np.int64)
        f["floats"] = np.zeros(9)
        f["big"] = np.zeros(9, np.int64)
        f["big"].attrs["vocabulary"] = np.arange(40, 60, dtype=np.int32)
    open_ = lambda name, T=4: TokenDataset(path, name, block_size=T, val_fraction=0.0, vocab_size=5)  # noqa: E731
    with pytest.raises(DataError, match=r"holds 4 tokens, shorter than one window of model.block_size \+ 1 = 5"):
        open_("short")
    with pytest.raises(DataError, match="must be 1-D integer token ids"):
        open_("matrix")
    with pytest.raises(DataError, match="must be 1-D integer token ids"):
        open_("floats")
    with pytest.raises(DataError, match="has 20 characters but model.vocab_size = 5"):
        open_("big")
    d = open_("bad")
    assert "token id 9 at position 3 of dataset 'bad'" in d.scan(0, 2)
    d.close()


def test_the_bundled_corpus_is_english_text(tmp_path):
    text = corpus_text("pydoc")
    assert len(text) > 300_000 and text.count(" the ") > 1000
    with pytest.raises(ConfigError, match="unknown corpus"):
        corpus_text("shakespeare")


def test_gpt_config_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="model.n_embd: 10 is not divisible by model.n_head = 3"):
        gpt_config("t.h5", model={"n_embd": 10, "n_head": 3})
    with pytest.raises(ConfigError, match="data.tokens: required"):
        gpt_config("t.h5", data={"tokens": ""})
    with pytest.raises(ConfigError, match="train.loss: kind = \"gpt\" trains with cross_entropy"):
        gpt_config("t.h5", train={"loss": "mse"})
    with pytest.raises(ConfigError, match="model.layers: not used"):
        gpt_config("t.h5", model={"layers": [{"type": "relu"}]})
    from helpers import config
    with pytest.raises(ConfigError, match="model.n_head: only used by kind = \"gpt\""):
        config("x.h5", model={"n_head": 2})


def _job(tmp_path, extra=""):
    make_tokens(tmp_path / "t.h5", n=3000)
    (tmp_path / "gpt.toml").write_text(f"""
[model]
kind = "gpt"
vocab_size = 12
block_size = 8
n_layer = 2
n_head = 2
n_embd = 16
[data]
path = "t.h5"
tokens = "tokens"
[train]
batch_size = 8
steps = 3
backend = "cpu"
eval_every = 0
[optim]
name = "adamw"
lr = 0.01
[checkpoint]
dir = "ck"
{extra}""")
    return str(tmp_path / "gpt.toml")


def test_bad_token_ids_are_found_at_start_up(tmp_path):
    cfg = _job(tmp_path)
    with h5py.File(tmp_path / "t.h5", "a") as f:
        f["tokens"][1234] = 40
    r = hpctrain("train", cfg)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("token id 40 at position 1234 of dataset 'tokens' (data.tokens) "
                                                      "is outside the vocabulary [0, 12) (model.vocab_size)")


def test_a_longer_context_than_the_checkpoints_position_table_is_one_line(tmp_path):
    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    r = hpctrain("train", cfg, "--set", "model.block_size=16")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "transformer.wpe.weight has shape (8, 16), the model needs (16, 16)" in r.stderr


def test_sample_prints_a_continuation_and_refuses_unknown_characters(tmp_path):
    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000003.h5")
    r = hpctrain("sample", ck, "--prompt", "dead ", "--tokens", "20", "--seed", "3")
    assert r.returncode == 0, r.stderr
    text = r.stdout.rstrip("\n")
    assert text.startswith("dead ") and len(text) == 25 and set(text) <= set("abcdefgh\n ")
    again = hpctrain("sample", ck, "--prompt", "dead ", "--tokens", "20", "--seed", "3")
    assert again.stdout == r.stdout  # a seed fixes the draw
    greedy = [hpctrain("sample", ck, "--prompt", "ab", "--tokens", "12", "--temperature", "0", "--seed", str(s)).stdout
              for s in (1, 2)]
    assert greedy[0] == greedy[1]
    r = hpctrain("sample", ck, "--prompt", "dex", "--tokens", "5")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "character 'x' (U+0078) at position 2 is not in the vocabulary of 10 characters" in r.stderr


def test_eval_on_a_token_file_the_model_cannot_read_names_what_is_wrong(tmp_path):
    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000003.h5")
    with h5py.File(tmp_path / "flat.h5", "w") as f:
        f["tokens"] = np.zeros((40, 2), np.uint16)  # 2-D: no token stream
    with h5py.File(tmp_path / "short.h5", "w") as f:
        f["tokens"] = np.zeros(5, np.uint16)  # fewer ids than one window of block_size + 1
    for name, said in (("flat.h5", "must be 1-D integer token ids"), ("short.h5", "shorter than one window")):
        r = hpctrain("eval", ck, "--data", str(tmp_path / name))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and said in r.stderr, r.stderr


def test_sampling_a_window_left_aligned_equals_a_shorter_context():
    """Causal attention: what follows the text in the window changes nothing before it."""
    from hpctrain.backend.cpu import CpuBackend
    from hpctrain.nn.gpt import GPTSpec
    from hpctrain.sample import Generator

    spec = GPTSpec(vocab_size=7, block_size=6, n_layer=1, n_head=2, n_embd=8)
    gen = Generator(spec, spec.init_params(0), CpuBackend())
    ids = [1, 2, 3]
    base = gen.logits(ids)
    window = np.array([[1, 2, 3, 6, 6, 6]])
    out, _ = gen.part.forward(gen.be, window)
    np.testing.assert_array_equal(out[2], base.astype(np.float32))


def test_a_short_run_learns_well_below_the_unigram_entropy(tmp_path):
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer
    from mpi4py import MPI

    text = make_tokens(tmp_path / "t.h5", n=6000)
    counts = np.array([text.count(ch) for ch in set(text)], dtype=np.float64)
    unigram = float(-(counts / counts.sum() * np.log(counts / counts.sum())).sum())
    cfg = gpt_config(tmp_path / "t.h5", model={"n_embd": 32, "block_size": 16},
                     train={"batch_size": 16, "steps": 150, "log_every": 50}, optim={"name": "adamw", "lr": 3e-3})
    mesh = Mesh(comm=MPI.COMM_SELF)
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    trainer.run()
    val = trainer.evaluate()["val_loss"]
    trainer.close()
    mesh.free()
    assert val < 0.6 * unigram, (val, unigram)
    assert math.isfinite(val)


def test_text2h5_never_overwrites_by_accident(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("abc abc\n")
    r = hpctrain("data", "text2h5", str(src), str(src))
    assert r.returncode == 2 and "is the input file itself" in r.stderr and src.read_text() == "abc abc\n"
    (tmp_path / "out.h5").write_text("precious")
    r = hpctrain("data", "text2h5", str(src), str(tmp_path / "out.h5"))
    assert r.returncode == 2 and "exists; pass --force" in r.stderr
    assert hpctrain("data", "text2h5", str(src), str(tmp_path / "out.h5"), "--force").returncode == 0
    r = hpctrain("data", "text2h5", str(src), str(src) + "/x.h5")  # a file used as a folder
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot write the token file" in r.stderr


def test_sample_decodes_with_the_checkpoints_own_vocabulary(tmp_path):
    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000003.h5")
    before = hpctrain("sample", ck, "--prompt", "ab", "--tokens", "10", "--seed", "1").stdout
    os.rename(tmp_path / "t.h5", tmp_path / "moved.h5")  # the data file is gone: the checkpoint still decodes
    assert hpctrain("sample", ck, "--prompt", "ab", "--tokens", "10", "--seed", "1").stdout == before
    other = tmp_path / "other.txt"
    other.write_text("xyz")
    assert hpctrain("data", "text2h5", str(other), str(tmp_path / "other.h5")).returncode == 0
    r = hpctrain("sample", ck, "--prompt", "ab", "--tokens", "3", "--vocab", str(tmp_path / "other.h5"))
    assert r.returncode == 2 and "is not the one the checkpoint was trained with (3 characters against" in r.stderr
    from hpctrain.text import read_vocabulary

    trained = read_vocabulary(str(tmp_path / "moved.h5"), "tokens").vocabulary
    same_size = "".join(trained[:-1]) + "\u00e9"  # one character swapped: as many, not the same
    (tmp_path / "same.txt").write_text(same_size, encoding="utf-8")
    assert hpctrain("data", "text2h5", str(tmp_path / "same.txt"), str(tmp_path / "same.h5")).returncode == 0
    r = hpctrain("sample", ck, "--prompt", "ab", "--tokens", "3", "--vocab", str(tmp_path / "same.h5"))
    assert r.returncode == 2 and f"(both {len(trained)} characters, but id" in r.stderr, r.stderr
    for bad in ("nan", "inf", "-1"):
        r = hpctrain("sample", ck, "--prompt", "ab", "--tokens", "3", "--temperature", bad)
        assert r.returncode == 2 and "--temperature must be a finite number >= 0" in r.stderr
    tiny = hpctrain("sample", ck, "--prompt", "ab", "--tokens", "3", "--temperature", "1e-30")
    assert tiny.returncode == 0, tiny.stderr
    from hpctrain.checkpoint import save_weights
    save_weights(str(tmp_path / "w.h5"), {"x": np.zeros(2)})
    r = hpctrain("sample", str(tmp_path / "w.h5"), "--prompt", "ab")
    assert r.returncode == 2 and "weights-only file: sample needs a checkpoint" in r.stderr


def test_a_corpus_is_for_language_models():
    from helpers import config
    with pytest.raises(ConfigError, match="data.corpus: a bundled corpus is text for kind = \"gpt\""):
        config("x.h5", data={"corpus": "pydoc"})
    with pytest.raises(ConfigError, match="data.corpus writes the dataset \"tokens\""):
        gpt_config("x.h5", data={"corpus": "pydoc", "tokens": "ids"})
