"""hpctrain eval: a checkpoint's loss and accuracy on its validation split or on any file, writing nothing."""

import json
import os
import subprocess
import sys

import h5py
import pytest

from helpers import make_classification, toml_job
from hpctrain.errors import ConfigError
from hpctrain.evaluate import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def trained(tmp_path):
    """A 6 -> 8 -> 3 MLP trained 6 steps on d.h5 (val_fraction 0.25, an evaluation at the end), its checkpoint."""
    make_classification(tmp_path / "d.h5", n=96)
    (tmp_path / "job.toml").write_text(toml_job(
        data={"val_fraction": 0.25}, train={"steps": 6, "eval_every": 6, "metrics": "m.jsonl"},
        checkpoint={"dir": "ck", "every": 6}))
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", "job.toml"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "ck" / "m.jsonl") as f:  # a bare metrics name lives in checkpoint.dir
        last = [r for r in map(json.loads, f) if "val_loss" in r][-1]
    return tmp_path, str(tmp_path / "ck" / "ckpt-00000006.h5"), last


def test_a_checkpoint_evaluates_to_what_its_run_logged(trained):
    folder, checkpoint, logged = trained
    lines, before = [], sorted(os.listdir(folder)) + sorted(os.listdir(folder / "ck"))
    got = evaluate(checkpoint, log=lines.append)
    assert got["val_loss"] == logged["val_loss"] and got["val_accuracy"] == logged["val_accuracy"]
    assert got["samples"] == 24
    assert lines == [f"{checkpoint}: loss {got['val_loss']:.4f}, accuracy {got['val_accuracy']:.4f} on the validation "
                     f"split of {folder / 'd.h5'} (24 samples, 1 rank(s))"]
    assert sorted(os.listdir(folder)) + sorted(os.listdir(folder / "ck")) == before  # nothing locked or written


def test_a_parameter_servers_overrides_repeated_evaluate_alike(trained):
    folder, checkpoint, logged = trained
    got = evaluate(checkpoint, overrides=['parallel.mode="async_ps"', "parallel.staleness=2"], log=lambda *a: None)
    assert got["val_loss"] == logged["val_loss"]


def test_another_file_is_evaluated_whole(trained, tmp_path):
    folder, checkpoint, logged = trained
    with h5py.File(folder / "d.h5", "r") as f:  # the validation rows alone, as a test file of their own
        x, y = f["x"][72:], f["y"][72:]
    with h5py.File(tmp_path / "test.h5", "w") as f:
        f["x"], f["y"] = x, y
    got = evaluate(checkpoint, data=str(tmp_path / "test.h5"), log=lambda *a: None)
    assert got["samples"] == 24
    assert got["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-12)
    assert got["val_accuracy"] == logged["val_accuracy"]


def test_a_test_file_smaller_than_a_training_batch(trained, tmp_path):
    """The run's batch is 8; a file of 5 samples is evaluated whole (the batch only sizes the chunks)."""
    folder, checkpoint, _ = trained
    with h5py.File(folder / "d.h5", "r") as f:
        x, y = f["x"][:5], f["y"][:5]
    with h5py.File(tmp_path / "small.h5", "w") as f:
        f["x"], f["y"] = x, y
    got = evaluate(checkpoint, data=str(tmp_path / "small.h5"), log=lambda *a: None)
    assert got["samples"] == 5


def test_a_config_evaluates_its_newest_checkpoint(trained):
    folder, checkpoint, logged = trained
    lines = []
    got = evaluate(str(folder / "job.toml"), log=lines.append)
    assert got["val_loss"] == logged["val_loss"] and lines[0].startswith(checkpoint)


def test_a_pipelined_runs_config_evaluates_as_data_parallel(trained, tmp_path):
    """eval lays any job out as data parallel: an interleaved 1F1B job's config too (its schedule needs pp >= 2)."""
    folder, checkpoint, logged = trained
    (folder / "il.toml").write_text(toml_job(
        data={"val_fraction": 0.25}, train={"steps": 6, "micro_batches": 2}, checkpoint={"dir": "ck"},
        parallel={"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2}))
    got = evaluate(str(folder / "il.toml"), log=lambda *a: None)  # in its 2 micro-batches: the sum's order differs
    assert got["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-12)
    assert got["val_accuracy"] == logged["val_accuracy"]
    with h5py.File(folder / "d.h5", "r") as f:
        x, y = f["x"][72:], f["y"][72:]
    with h5py.File(tmp_path / "test.h5", "w") as f:
        f["x"], f["y"] = x, y
    assert evaluate(str(folder / "il.toml"), data=str(tmp_path / "test.h5"), log=lambda *a: None)["samples"] == 24


def test_no_validation_split_and_command_line_paths(trained, tmp_path, monkeypatch):
    folder, checkpoint, _ = trained
    with pytest.raises(ConfigError, match=r"the validation split of .*d.h5 is empty \(data.val_fraction = 0.0\): "
                                          "pass --data FILE"):
        evaluate(checkpoint, overrides=["data.val_fraction=0.0"], log=lambda *a: None)
    monkeypatch.chdir(folder)  # a --set path resolves against the working directory, as for train
    got = evaluate(str(folder / "job.toml"), overrides=["checkpoint.init=ck/ckpt-00000006.h5"], log=lambda *a: None)
    assert got["samples"] == 24


def test_no_weights_is_one_line(tmp_path):
    make_classification(tmp_path / "d.h5", n=32)
    (tmp_path / "job.toml").write_text(toml_job(checkpoint={"dir": "empty"}))
    with pytest.raises(ConfigError, match="no weights to evaluate: set checkpoint.init, or train first"):
        evaluate(str(tmp_path / "job.toml"))


def test_a_file_that_is_neither_checkpoint_nor_config_says_so(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")  # an export
    with pytest.raises(ConfigError, match=r"m.safetensors is neither an hpctrain checkpoint nor a TOML config: eval "
                                          r"takes a checkpoint \(ckpt-\*.h5\) or a config file \(.toml\)"):
        evaluate(str(tmp_path / "m.safetensors"))
    (tmp_path / "bad.toml").write_text("[train\n")
    with pytest.raises(ConfigError, match="bad.toml: malformed TOML"):  # a config: its own error
        evaluate(str(tmp_path / "bad.toml"))


def test_the_command_and_its_bad_input(trained):
    folder, checkpoint, _ = trained
    env = {**os.environ, "PYTHONPATH": ROOT}
    ok = subprocess.run([sys.executable, "-m", "hpctrain", "eval", checkpoint], cwd=folder, capture_output=True,
                        text=True, env=env)
    assert ok.returncode == 0 and "on the validation split of" in ok.stdout, ok.stderr
    assert not os.path.exists(folder / "ck" / "hpctrain.lock")
    bad = subprocess.run([sys.executable, "-m", "hpctrain", "eval", checkpoint, "--data", "missing.h5"], cwd=folder,
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "missing.h5" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_training_zero_steps_says_it_trains_nothing(trained):
    """train.steps = 0 with checkpoint.init loaded the weights and trained nothing, without saying so."""
    from mpi4py import MPI

    from helpers import run_trainer
    from hpctrain.config import load_config
    from hpctrain.parallel.mesh import Mesh

    folder, checkpoint, _ = trained
    cfg = load_config(str(folder / "job.toml"), ["train.steps=0", f'checkpoint.init="{checkpoint}"',
                                                 'checkpoint.dir=""', 'train.metrics=""'])
    lines = []
    mesh = Mesh(comm=MPI.COMM_SELF)
    run_trainer(cfg, mesh, log=lines.append)
    mesh.free()
    assert f"train.steps = 0: nothing to train (checkpoint.init {checkpoint} loaded); to evaluate a checkpoint on a " \
           "file: hpctrain eval CHECKPOINT --data FILE" in lines


def test_on_record_gets_every_metrics_record_as_a_dict(tmp_path):
    """The hook for TensorBoard or a CSV: the records train.metrics gets, without a metrics file too."""
    from mpi4py import MPI

    from hpctrain.config import load_config
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(data={"val_fraction": 0.25}, train={"steps": 4, "log_every": 2,
                                                                                     "eval_every": 4}))
    cfg = load_config(str(tmp_path / "job.toml"))
    records = []
    mesh = Mesh(comm=MPI.COMM_SELF)
    t = Trainer(cfg, mesh=mesh, log=lambda *a: None, on_record=records.append)
    t.run()
    t.close()
    mesh.free()
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [4]
    assert all(isinstance(r, dict) for r in records) and any("memory" in r for r in records)
