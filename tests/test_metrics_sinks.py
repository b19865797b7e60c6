"""The metrics records for other tools (hpctrain/train/sinks.py): a CSV table when ``train.metrics`` ends in
``.csv``, TensorBoard scalars in ``train.tensorboard``; both resume at the checkpoint's step."""

import csv
import json
import math
import struct

import pytest

from helpers import config, make_classification, run_trainer as run
from hpctrain.errors import ConfigError
from hpctrain.parallel.mesh import Mesh
from hpctrain.plot import read_metrics
from hpctrain.train.metrics import MetricsFile
from hpctrain.train.sinks import scalars


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


def table(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_scalars_name_nested_values_by_path_and_leave_the_memory_table_out():
    record = {"step": 4, "loss": 0.5, "skipped": True, "stages": [{"stage": 0, "bubble": 0.25}, {"stage": 1}],
              "memory": [{"rank": 0, "param_bytes": 10}]}
    assert scalars(record) == {"step": 4, "loss": 0.5, "skipped": 1, "stages.0.stage": 0, "stages.0.bubble": 0.25,
                               "stages.1.stage": 1}


def test_a_csv_table_widens_its_header_when_a_new_name_comes(tmp_path):
    path = tmp_path / "m.csv"
    m = MetricsFile(str(path))
    m.write({"step": 1, "loss": 2.5, "lr": 0.1})
    m.write({"step": 2, "loss": float("nan"), "lr": 0.1, "skipped": True})  # a skipped step: nan, then a new column
    m.write({"step": 2, "val_loss": 2.0, "val_accuracy": 0.5})
    m.write({"step": 2, "memory": [{"rank": 0}]})  # nothing but the step once the per-rank table is left out
    m.close()
    rows = table(path)
    assert list(rows[0]) == ["step", "loss", "lr", "skipped", "val_loss", "val_accuracy"]
    assert [r["step"] for r in rows] == ["1", "2", "2"]
    assert rows[0] == {"step": "1", "loss": "2.5", "lr": "0.1", "skipped": "", "val_loss": "", "val_accuracy": ""}
    assert math.isnan(float(rows[1]["loss"])) and rows[1]["skipped"] == "1" and rows[2]["val_accuracy"] == "0.5"


def test_numpy_scalars_are_written_as_numbers(tmp_path):
    """The parameter server's loss is a numpy float64, whose repr is "np.float64(...)": hpctrain plot refused it."""
    import numpy as np

    path = tmp_path / "m.csv"
    m = MetricsFile(str(path))
    m.write({"step": np.int64(1), "loss": np.float64(0.69), "rate": np.float32(2.5)})
    m.close()
    assert path.read_text().splitlines()[1] == "1,0.69,2.5"
    series, _ = read_metrics(str(path), path.read_text())  # hpctrain plot refused "np.float64(0.69)"
    assert list(series["loss"][1]) == [0.69]
    m = MetricsFile(str(tmp_path / "m.jsonl"))  # and in JSON lines, where numpy's ints and float32 would not go
    m.write({"step": np.int64(1), "loss": np.float64(0.69), "rate": np.float32(2.5)})
    m.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 1, "loss": 0.69, "rate": 2.5}


def test_a_file_that_is_not_a_metrics_table_is_refused_not_overwritten(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("name,value\nx,1\n")
    with pytest.raises(ConfigError, match="not a metrics table hpctrain wrote"):
        MetricsFile(str(path), resume_step=3)
    assert path.read_text() == "name,value\nx,1\n"


def test_a_csv_metrics_run_resumes_at_the_checkpoints_step(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ckdir, metrics = str(tmp_path / "ck"), tmp_path / "m.csv"
    train = {"steps": 6, "metrics": str(metrics), "log_every": 1, "eval_every": 3}
    run(config(tmp_path / "d.h5", train=train, checkpoint={"dir": ckdir, "every": 3}), mesh)
    run(config(tmp_path / "d.h5", train=train, checkpoint={"dir": ckdir, "resume": ckdir + "/ckpt-00000003.h5"}),
        mesh)
    rows = table(metrics)
    assert [int(r["step"]) for r in rows if r["loss"]] == [1, 2, 3, 4, 5, 6]
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [3, 6]
    assert all(float(r["loss"]) > 0 for r in rows if r["loss"]) and {"samples_per_s", "grad_norm"} <= set(rows[0])
    series, _ = read_metrics(str(metrics), metrics.read_text())  # hpctrain plot reads the table as it reads JSONL
    assert series["loss"][0] == [1, 2, 3, 4, 5, 6] and series["val_loss"][0] == [3, 6]
    assert series["loss"][1] == [float(r["loss"]) for r in rows if r["loss"]]


def events(folder):
    """(tag, step, value) of every scalar in a folder's TensorBoard event files, read with tensorboardX's own
    protobuf classes (the record format: length, its CRC, the event, its CRC)."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    found = []
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            found += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return found


def test_tensorboard_scalars_carry_every_number_of_every_record(tmp_path, mesh):
    pytest.importorskip("tensorboardX")
    make_classification(tmp_path / "d.h5", n=96)
    board = tmp_path / "tb"
    run(config(tmp_path / "d.h5", train={"steps": 4, "log_every": 2, "eval_every": 4, "tensorboard": str(board)}),
        mesh)
    found = events(board)
    assert [step for tag, step, _ in found if tag == "train/loss"] == [2, 4]  # train/ and val/ groups
    assert [step for tag, step, _ in found if tag == "val/accuracy"] == [4]
    assert {"train/lr", "train/samples_per_s", "train/grad_norm", "val/loss"} <= {tag for tag, _, _ in found}
    assert all(tag.startswith(("train/", "val/")) for tag, _, _ in found)
    assert all(value > 0 for tag, _, value in found if tag == "train/loss")


def test_a_bare_tensorboard_name_lands_in_the_run_folder_and_a_missing_package_is_one_line(tmp_path, monkeypatch):
    make_classification(tmp_path / "d.h5", n=96)
    cfg = config(tmp_path / "d.h5", train={"tensorboard": "tb"}, checkpoint={"dir": str(tmp_path / "run")})
    assert cfg.train.tensorboard == str(tmp_path / "run" / "tb")
    import sys

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"needs the tensorboardX package \(pip install 'hpctrain\[tensorboard\]'"):
        MetricsFile("", tensorboard=str(tmp_path / "tb"))


def test_a_tensorboard_path_that_cannot_be_a_folder_is_one_line(tmp_path):
    pytest.importorskip("tensorboardX")
    (tmp_path / "afile").write_text("")
    for where in (tmp_path / "afile", tmp_path / "afile" / "tb"):
        with pytest.raises(ConfigError, match=rf"train.tensorboard: {where} is not a folder that can be written"):
            MetricsFile("", tensorboard=str(where))


def test_a_resume_drops_a_record_cut_short_instead_of_gluing_the_next_one_to_it(tmp_path, mesh):
    """A run killed while writing a line leaves it without its newline; the resumed run's first record used to
    be appended onto it (two records on one line, the file unreadable by hpctrain plot from there on)."""
    make_classification(tmp_path / "d.h5", n=96)
    ckdir, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    train = {"steps": 4, "metrics": str(metrics), "log_every": 1, "eval_every": 0}
    run(config(tmp_path / "d.h5", train=train, checkpoint={"dir": ckdir, "every": 4}), mesh)
    with open(metrics, "a") as f:
        f.write('{"step": 5, "loss": 2.08, "lr": 0.0')  # the killed run's last line, cut short
    train["steps"] = 6
    run(config(tmp_path / "d.h5", train=train, checkpoint={"dir": ckdir, "resume": ckdir + "/ckpt-00000004.h5"}),
        mesh)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line is one record
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    # cut just before its newline: a whole record, kept, and the next one starts on a line of its own
    metrics.write_text(metrics.read_text().rstrip("\n"))
    train["steps"] = 7
    run(config(tmp_path / "d.h5", train=train, checkpoint={"dir": ckdir, "resume": ckdir + "/ckpt-00000006.h5"}),
        mesh)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6, 7]


def test_throughput_leaves_evaluation_out(tmp_path, mesh, monkeypatch):
    """samples/s is training's: an evaluation (here made to take 0.5 s) between two log lines is not in it."""
    import time

    from hpctrain.train.loop import Trainer

    real = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate", lambda self: (time.sleep(0.5), real(self))[1])
    make_classification(tmp_path / "d.h5", n=96)
    metrics = tmp_path / "m.jsonl"
    run(config(tmp_path / "d.h5", train={"steps": 4, "metrics": str(metrics), "log_every": 2, "eval_every": 1,
                                         "batch_size": 8}), mesh)
    rates = [json.loads(line)["samples_per_s"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    # with the two 0.5 s evaluations counted, a line's rate would be at most 2 steps x 8 samples / 1 s
    assert len(rates) == 2 and all(rate > 10 * 16 for rate in rates), rates


def test_a_stop_signal_logs_the_steps_since_the_last_training_line(tmp_path, mesh):
    """A run stopped at step 7 with log_every 5 writes a training record for step 7 (steps 6 and 7 were
    otherwise never logged, and a resume from the step-7 checkpoint would not log them either)."""
    from hpctrain.train import Trainer
    from hpctrain.train.stop import StopFlag

    make_classification(tmp_path / "d.h5", n=96)
    metrics = tmp_path / "m.jsonl"
    flag = StopFlag()
    lines = []
    try:
        t = Trainer(config(tmp_path / "d.h5", train={"steps": 20, "metrics": str(metrics), "log_every": 5,
                                                     "eval_every": 0}),
                    mesh=mesh, log=lines.append, stop=flag)
        real = t.train_step

        def step(number, lr):
            if number == 6:  # during the 7th step: as if SIGUSR1 had come
                flag.name = "SIGUSR1"
            return real(number, lr)

        t.train_step = step
        t.run()
        t.close()
    finally:
        flag.restore()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert steps == [5, 7]
    assert any(line.startswith("step      7/20") for line in lines)
    assert lines.index(next(line for line in lines if line.startswith("step      7/20"))) < \
        lines.index(next(line for line in lines if "stopping at step 7" in line))
