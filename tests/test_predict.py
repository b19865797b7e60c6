"""hpctrain predict: a checkpoint's outputs and predicted classes for every sample of a file."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

from helpers import make_classification, make_tokens, toml_job
from hpctrain.errors import DataError
from hpctrain.evaluate import evaluate
from hpctrain.predict import predict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(folder, text):
    (folder / "job.toml").write_text(text)
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", "job.toml"], cwd=folder, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return str(sorted((folder / "ck").glob("ckpt-*.h5"))[-1])


@pytest.fixture
def mlp(tmp_path):
    make_classification(tmp_path / "d.h5", n=96)
    return tmp_path, train(tmp_path, toml_job(train={"steps": 6}, checkpoint={"dir": "ck"}))


def test_the_outputs_agree_with_eval_on_the_same_file(mlp):
    folder, checkpoint = mlp
    said = predict(checkpoint, str(folder / "d.h5"), str(folder / "p.h5"), batch=7)  # chunks that do not divide 96
    assert said == f"{folder / 'p.h5'}: logits and predictions for 96 samples of {folder / 'd.h5'} (datasets " \
                   "'outputs' and 'predictions')"
    with h5py.File(folder / "p.h5", "r") as f, h5py.File(folder / "d.h5", "r") as d:
        logits, labels, y = f["outputs"][...], f["predictions"][...], d["y"][...]
    assert logits.shape == (96, 3) and np.array_equal(labels, logits.argmax(axis=1))
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    loss = float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(96), y]))
    got = evaluate(checkpoint, data=str(folder / "d.h5"), log=lambda *a: None)
    assert got["val_accuracy"] == np.mean(labels == y)
    assert got["val_loss"] == pytest.approx(loss, rel=1e-6)


def test_a_gpt_predicts_the_token_after_each_window(tmp_path):
    make_tokens(tmp_path / "t.h5")
    text = ('[model]\nkind = "gpt"\nvocab_size = 12\nblock_size = 8\nn_layer = 1\nn_head = 2\nn_embd = 8\n'
            '[data]\npath = "t.h5"\ntokens = "tokens"\n[train]\nbatch_size = 4\nsteps = 2\nbackend = "cpu"\n'
            '[checkpoint]\ndir = "ck"\n')
    checkpoint = train(tmp_path, text)
    said = predict(checkpoint, str(tmp_path / "t.h5"), str(tmp_path / "n.h5"))
    assert "next-token logits and predictions for 249 windows" in said  # 2000 ids: (2000 - 1) // 8 windows
    with h5py.File(tmp_path / "n.h5", "r") as f:
        assert f["outputs"].shape == (249, 12) and f["predictions"].shape == (249,)


def test_bad_input_is_one_line(mlp, tmp_path):
    folder, checkpoint = mlp
    with h5py.File(tmp_path / "wide.h5", "w") as f:
        f["x"] = np.zeros((4, 5), np.float32)
    with pytest.raises(DataError, match=r"'x' has shape \(4, 5\): the model takes 6 features per row"):
        predict(checkpoint, str(tmp_path / "wide.h5"), str(tmp_path / "o.h5"))
    with h5py.File(tmp_path / "nan.h5", "w") as f:
        f["x"] = np.array([[0.0] * 6, [0.0] * 5 + [np.nan]], np.float32)
    with pytest.raises(DataError, match=r"'x' row 1, value 5 is nan: every input must be finite"):
        predict(checkpoint, str(tmp_path / "nan.h5"), str(tmp_path / "o.h5"))
    assert not (tmp_path / "o.h5").exists()
    with h5py.File(tmp_path / "big.h5", "w") as f:  # float64 beyond float32: one line, the stored value in it
        f["x"] = np.array([[0.0] * 6, [1e300] + [0.0] * 5], np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy RuntimeWarning on the way
        with pytest.raises(DataError, match=r"'x' row 1, value 0 is 1e\+300 \(beyond float32's range\): every input"):
            predict(checkpoint, str(tmp_path / "big.h5"), str(tmp_path / "o.h5"))
    with pytest.raises(DataError, match=r"no dataset 'inputs' \(--inputs\); it has: x"):
        predict(checkpoint, str(tmp_path / "nan.h5"), str(tmp_path / "o.h5"), inputs="inputs")
    (tmp_path / "o.h5").write_text("")
    with pytest.raises(DataError, match="o.h5 exists; pass --force to replace it"):
        predict(checkpoint, str(folder / "d.h5"), str(tmp_path / "o.h5"))
    before = Path(checkpoint).read_bytes()
    with pytest.raises(DataError, match="is the checkpoint itself"):  # --force must not destroy what it reads
        predict(checkpoint, str(folder / "d.h5"), checkpoint, force=True)
    assert Path(checkpoint).read_bytes() == before
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "predict", checkpoint, "--data", "missing.h5", "--out",
                           "x.h5"], cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and "missing.h5" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
