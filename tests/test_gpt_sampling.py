"""nanoGPT's data semantics: random windows (data.sampling = "random"), a separate validation file
(data.val_path), evaluation on a few batches (train.eval_batches), model.vocab_size read from the token file;
and the float settings that would not be the number written (issue 52)."""

import dataclasses

import h5py
import numpy as np
import pytest

from helpers import gpt_config, make_tokens
from hpctrain.config import load_config
from hpctrain.data import TokenDataset, WithValidation, open_dataset
from hpctrain.sampling import RandomSampler, make_sampler
from hpctrain.errors import ConfigError, DataError
from hpctrain.train import Trainer


def test_random_windows_are_a_pure_function_of_seed_and_step_split_by_rank():
    whole = RandomSampler(1000, 8, seed=3)
    again = RandomSampler(1000, 8, seed=3)
    for step in (0, 1, 57):
        want = np.random.default_rng([3, step]).integers(0, 1000, 8)
        np.testing.assert_array_equal(whole.global_rows(step), want)  # the documented formula
        np.testing.assert_array_equal(again.local_rows(step), want)  # no state: any order of steps, any resume
        for dp in (2, 4):
            shares = [RandomSampler(1000, 8, seed=3, dp_rank=r, dp_size=dp).local_rows(step) for r in range(dp)]
            np.testing.assert_array_equal(np.concatenate(shares), want)
    assert not np.array_equal(whole.global_rows(0), whole.global_rows(1))
    assert not np.array_equal(whole.global_rows(0), RandomSampler(1000, 8, seed=4).global_rows(0))
    with pytest.raises(DataError, match="not divisible by the data-parallel size 3"):
        RandomSampler(1000, 8, seed=0, dp_size=3)


def test_random_windows_start_anywhere_in_the_training_split(tmp_path):
    ids = np.arange(43) % 7
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["tokens"] = ids
    d = TokenDataset(str(tmp_path / "t.h5"), "tokens", block_size=4, val_fraction=0.1, vocab_size=7)
    assert (d.n_train, d.n_val) == (9, 1)  # (43 - 1) // 4 = 10 windows; the validation window starts at 36
    assert d.n_starts == 9 * 4 + 1 - 4  # the last training window [32, 37) ends inside the first validation one
    x, y = d.read_at(np.array([5, 0, 32]))
    for row, a in enumerate([5, 0, 32]):
        np.testing.assert_array_equal(x[row], ids[a : a + 4])
        np.testing.assert_array_equal(y[4 * row : 4 * row + 4], ids[a + 1 : a + 5])
    d.close()
    whole = TokenDataset(str(tmp_path / "t.h5"), "tokens", block_size=4, val_fraction=0.0, vocab_size=7)
    assert whole.n_starts == 43 - 4  # nanoGPT's randint(len(data) - block_size): every token a window's start
    assert whole.read_at(np.array([38]))[1][-1] == ids[-1]
    whole.close()


def _run(cfg, **train):
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
    t = Trainer(cfg, log=lambda *a: None)
    t.run()
    params = t.params.to_host_dict()
    t.close()
    return params


def _assert_same(a, b, rtol=1e-5):
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=1e-6, err_msg=name)


def test_random_windows_train_the_same_in_micro_batches_and_across_a_resume(tmp_path):
    make_tokens(tmp_path / "t.h5")
    cfg = gpt_config(tmp_path / "t.h5", data={"sampling": "random", "seed": 5},
                     train={"steps": 4, "batch_size": 8}, checkpoint={"dir": str(tmp_path / "ck"), "keep": 5})
    straight = _run(cfg)
    _assert_same(_run(cfg, micro_batches=4), straight)
    ck = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=str(tmp_path / "ck2")))
    _run(ck, steps=2)  # a checkpoint at step 2, then the same run resumed to step 4
    np.testing.assert_equal(_run(ck), straight)  # bit for bit: the stream went on where it stopped
    windows = gpt_config(tmp_path / "t.h5", train={"steps": 4, "batch_size": 8})
    assert any(not np.array_equal(v, straight[k]) for k, v in _run(windows).items())  # other samples


def test_a_separate_validation_file_and_eval_batches(tmp_path):
    text = make_tokens(tmp_path / "train.h5", n=2000)
    make_tokens(tmp_path / "val.h5", n=500, seed=1)
    cfg = gpt_config(tmp_path / "train.h5", data={"val_path": str(tmp_path / "val.h5")},
                     train={"steps": 2, "batch_size": 4})
    assert len(text) == 2000
    data = open_dataset(cfg, None, type("M", (), {"block_size": 8, "vocab_size": 12})())
    assert isinstance(data, WithValidation)
    assert (data.n_train, data.n_val) == ((2000 - 1) // 8, (500 - 1) // 8)  # every window of train.h5 trains
    with h5py.File(tmp_path / "val.h5", locking=False) as f:
        np.testing.assert_array_equal(data.read(np.array([data.n_train + 2]))[0][0], f["tokens"][16:24])
    with h5py.File(tmp_path / "train.h5", locking=False) as f:
        np.testing.assert_array_equal(data.read(np.array([2]))[0][0], f["tokens"][16:24])
    assert make_sampler(cfg, data).n_train == data.n_train
    data.close()
    t = Trainer(cfg, log=lambda *a: None)
    t.run()
    full = t.runner.evaluate(count=True)
    assert full["samples"] == (500 - 1) // 8
    some = t.runner.evaluate(count=True, batches=2)
    assert some["samples"] == 2 * 4 and some["val_loss"] != full["val_loss"]
    t.close()
    limited = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=2))
    t = Trainer(limited, log=lambda *a: None)
    t.run()
    assert t.evaluate()["val_loss"] == pytest.approx(some["val_loss"], rel=1e-6)  # the same first two batches
    t.close()


def test_a_validation_file_of_another_vocabulary_is_refused(tmp_path):
    make_tokens(tmp_path / "train.h5")
    make_tokens(tmp_path / "val.h5", vocab="abcdefghij\n ")
    cfg = gpt_config(tmp_path / "train.h5", data={"val_path": str(tmp_path / "val.h5")})
    with pytest.raises(DataError, match=r"data.val_path .*val.h5: its vocabulary \(12 characters\) is not the one"):
        Trainer(cfg, log=lambda *a: None)
    with pytest.raises(ConfigError, match="data.val_path: is data.path"):
        gpt_config(tmp_path / "train.h5", data={"val_path": str(tmp_path / "train.h5")})


def test_sampling_and_eval_batches_bad_values():
    with pytest.raises(ConfigError, match="data.sampling: expected one of 'windows', 'random'"):
        gpt_config("t.h5", data={"sampling": "shuffled"})
    with pytest.raises(ConfigError, match="train.eval_batches: must be >= 0"):
        gpt_config("t.h5", train={"eval_batches": -1})
    from helpers import config
    with pytest.raises(ConfigError, match='data.sampling: "random" draws token offsets: for kind = "gpt"'):
        config("x.h5", data={"sampling": "random"})


def _toml(tmp_path, model="", data=""):
    (tmp_path / "gpt.toml").write_text(f"""
[model]
kind = "gpt"
block_size = 8
n_layer = 1
n_head = 2
n_embd = 8
{model}
[data]
path = "t.h5"
tokens = "tokens"
{data}
""")
    return str(tmp_path / "gpt.toml")


def test_vocab_size_is_read_from_the_token_file_when_left_out(tmp_path):
    make_tokens(tmp_path / "t.h5", vocab="abcdefgh\n ")
    assert load_config(_toml(tmp_path)).model.vocab_size == 10  # the stored vocabulary
    assert load_config(_toml(tmp_path, model="vocab_size = 64")).model.vocab_size == 64  # as written
    with h5py.File(tmp_path / "t.h5", "a") as f:  # a file without a vocabulary (bin2h5 of a nanoGPT .bin)
        del f["tokens"].attrs["vocabulary"]
        f["tokens"][7] = 40
    assert load_config(_toml(tmp_path)).model.vocab_size == 41  # its largest id + 1
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f["tokens"] = np.arange(100)
    assert load_config(_toml(tmp_path, data='val_path = "v.h5"')).model.vocab_size == 100  # the larger file's
    with h5py.File(tmp_path / "t.h5", "a") as f:
        f["tokens"].attrs["n_vocab"] = 50257  # a tokenizer's (data text2h5 --tokenizer gpt2)
    assert load_config(_toml(tmp_path)).model.vocab_size == 50257
    (tmp_path / "t.h5").unlink()
    assert load_config(_toml(tmp_path)).model.vocab_size == 50304  # no file: nanoGPT's default; start-up says why
    cfg = load_config(_toml(tmp_path, data='corpus = "pydoc"'))  # the corpus's vocabulary, before it is written
    from hpctrain.text import CharTokenizer, corpus_text
    assert cfg.model.vocab_size == len(CharTokenizer.from_text(corpus_text("pydoc")))
    assert "vocab_size = " in cfg.to_toml()  # what a checkpoint keeps: the number, not "from the data"


@pytest.mark.parametrize("setting, message", [
    ("optim.eps = 1e308", r"optim.eps: 1e308 overflows float32 \(at most 3.402823e\+38\)"),
    ("optim.lr = 1e-400", r"optim.lr: 1e-400 is below double precision's range and reads as 0; write 0"),
    ("optim.lr = 1e-39", r"optim.lr: 1e-39 is below float32's smallest normal number"),
    ("optim.betas = [0.9, 1e-60]", r"optim.betas\[1\]: 1e-60 is below float32's smallest normal number"),
    ("optim.weight_decay = 5e-324", r"optim.weight_decay: 5e-324 is below float32's smallest normal"),
    ("train.grad_clip = 1e39", r"train.grad_clip: 1e39 overflows float32"),
    ("optim.min_lr = 0.0e-999", None),  # zero written as zero stays allowed
    ("data.val_fraction = 1e-400", r"data.val_fraction: 1e-400 is below double precision's range"),
])
def test_floats_that_would_not_be_the_number_written_are_refused(tmp_path, setting, message):
    make_tokens(tmp_path / "t.h5")
    section, rest = setting.split(".", 1)
    path = _toml(tmp_path)
    text = open(path).read() + f"[{section}]\n{rest}\n" if section != "data" else \
        open(path).read().replace('tokens = "tokens"', f'tokens = "tokens"\n{rest}')
    (tmp_path / "file.toml").write_text(text)
    for how in (lambda: load_config(str(tmp_path / "file.toml")),
                lambda: load_config(path, [setting.replace(" ", "")])):  # in the file and as --set
        if message is None:
            how()
            continue
        with pytest.raises(ConfigError, match=message) as e:
            how()
        assert "\n" not in str(e.value)


def test_a_layernorm_eps_below_float32_is_refused():
    from helpers import config
    with pytest.raises(ConfigError, match=r"model.layers\[1\].eps: 1e-45 is below float32's smallest normal"):
        config("x.h5", model={"layers": [{"type": "linear", "in": 6, "out": 3},
                                         {"type": "layernorm", "dim": 3, "eps": float("1e-45")}]})
