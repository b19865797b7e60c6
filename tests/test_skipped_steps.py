"""train.max_skipped_steps: a run that keeps producing non-finite gradients stops, keeping its good checkpoints."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import config, folder_listing, make_classification, toml_job
from launch import mpi_command
from hpctrain.checkpoint import list_checkpoints
from hpctrain.errors import ConfigError, NonFiniteError
from hpctrain.train import Trainer
from hpctrain.train.step import StepRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_diverging_run_stops_after_max_skipped_steps_and_keeps_the_good_checkpoint(tmp_path, ranks):
    if ranks > 1 and MPIEXEC is None:
        pytest.skip("mpiexec not found (pip install hpctrain[mpich])")
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 3}, checkpoint={"dir": "ck", "keep": 1}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "MPI_LOCALRANKID"))}
    env["PYTHONPATH"] = ROOT
    launcher = mpi_command(MPIEXEC, ranks) if ranks > 1 else []

    def train(*overrides):
        sets = [arg for item in overrides for arg in ("--set", item)]
        return subprocess.run([*launcher, sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml"), *sets],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    good = train()
    assert good.returncode == 0, good.stderr
    ck = str(tmp_path / "ck")
    before = digest(os.path.join(ck, "ckpt-00000003.h5"))
    # resumed with a learning rate that blows the weights up: every step from then on is non-finite
    bad = train("optim.lr=1e30", "train.steps=50", "train.skip_nonfinite=true", "train.max_skipped_steps=4",
                'checkpoint.allow_changed=["optim.lr"]')  # the resumed run's settings differ on purpose
    assert bad.returncode == 2, bad.stdout + bad.stderr
    skips = [int(s) for s in re.findall(r"step (\d+): non-finite gradients, step skipped", bad.stdout)]
    assert len(skips) == 4 and skips == list(range(skips[0], skips[0] + 4)), bad.stdout
    errors = [line for line in bad.stderr.splitlines() if "hpctrain: error" in line]
    where = " [rank 0/2]" if ranks > 1 else ""
    assert errors == [f"hpctrain: error{where}: step {skips[-1]}: 4 non-finite steps skipped in a row "
                      "(train.max_skipped_steps = 4): the run diverged; no checkpoint written; the newest checkpoint, "
                      f"{ck}/ckpt-00000003.h5, is kept; lower optim.lr or set train.grad_clip"], bad.stderr
    assert "Traceback" not in bad.stderr
    # keep = 1, yet the good checkpoint is still there, unchanged, and nothing else was written
    assert folder_listing(ck) == ["ckpt-00000003.h5", "ckpt-00000003.shards"] and digest(os.path.join(ck, "ckpt-00000003.h5")) == before


def poison(monkeypatch, steps):
    """Non-finite gradients at these 0-based steps (the norm, and so the skip decision, sees them)."""
    finish = StepRunner._finish

    def poisoned(self, step, lr):
        if step in steps:
            self.grads.data[0] = np.nan
        return finish(self, step, lr)

    monkeypatch.setattr(StepRunner, "_finish", poisoned)


def test_fewer_non_finite_steps_in_a_row_than_the_limit_are_skipped_and_training_goes_on(tmp_path, mesh, monkeypatch):
    make_classification(tmp_path / "d.h5", n=64)
    poison(monkeypatch, {3, 4, 6})  # steps 4 and 5 (two in a row), then 7
    ck, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    lines = []
    t = Trainer(config(tmp_path / "d.h5", train={"steps": 9, "skip_nonfinite": True, "max_skipped_steps": 3,
                                                 "metrics": str(metrics)},
                       checkpoint={"dir": ck, "every": 1, "keep": 20}), mesh=mesh, log=lines.append)
    t.run()
    t.close()
    assert t.step == 9 and t.optim.step_count == 6
    skipped = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("skipped")]
    assert skipped == [4, 5, 7]
    # no checkpoint of weights that just gave non-finite gradients: each waits for the next finite step
    assert [s for s, _ in list_checkpoints(ck)] == [1, 2, 3, 6, 8, 9]
    assert sum("checkpoint deferred" in line for line in lines) == 2


def test_the_final_checkpoint_is_written_after_fewer_skipped_steps_than_the_limit(tmp_path, mesh, monkeypatch):
    make_classification(tmp_path / "d.h5", n=64)
    poison(monkeypatch, {7, 8})  # the last two steps
    ck = str(tmp_path / "ck")
    t = Trainer(config(tmp_path / "d.h5", train={"steps": 9, "skip_nonfinite": True, "max_skipped_steps": 3},
                       checkpoint={"dir": ck, "every": 1, "keep": 20}), mesh=mesh, log=lambda *a: None)
    t.run()
    t.close()
    assert [s for s, _ in list_checkpoints(ck)] == [1, 2, 3, 4, 5, 6, 7, 9] and t.optim.step_count == 7


def test_the_limit_of_non_finite_steps_in_a_row_stops_the_run_without_a_checkpoint(tmp_path, mesh, monkeypatch):
    make_classification(tmp_path / "d.h5", n=64)
    poison(monkeypatch, {3, 4})
    ck = str(tmp_path / "ck")
    t = Trainer(config(tmp_path / "d.h5", train={"steps": 9, "skip_nonfinite": True, "max_skipped_steps": 2},
                       checkpoint={"dir": ck, "every": 1, "keep": 1}), mesh=mesh, log=lambda *a: None)
    try:
        with pytest.raises(NonFiniteError, match=r"^step 5: 2 non-finite steps skipped in a row \(train.max_skipped_"
                                                 r"steps = 2\): the run diverged; no checkpoint written; the newest "
                                                 r"checkpoint, .*ckpt-00000003.h5, is kept"):
            t.run()
    finally:
        t.close()
    assert [s for s, _ in list_checkpoints(ck)] == [3]


def test_max_skipped_steps_is_checked(tmp_path):
    assert config("x.h5").train.max_skipped_steps == 10
    for value, message in ((0, "train.max_skipped_steps: must be >= 1, got 0"),
                           (1.5, "train.max_skipped_steps: expected int, got float 1.5")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config("x.h5", train={"max_skipped_steps": value})


# --------------------------------------------------------------------------- finite gradients that overflow the state


def test_the_optimizer_finds_an_update_that_would_overflow_its_float32_state():
    from hpctrain.backend import get_backend
    from hpctrain.config import load_config
    from hpctrain.optim import make_optimizer
    from hpctrain.params import FlatBuffer, ParamLayout

    be = get_backend("cpu")
    layout = ParamLayout([("a.weight", (3, 4)), ("b.weight", (5,))])
    for name, slot in (("adamw", "exp_avg_sq"), ("adam", "exp_avg_sq"), ("sgd", "momentum_buffer")):
        cfg = load_config("jobs/configs/digits.toml", [f'optim.name="{name}"', "optim.momentum=0.9"]
                          if name == "sgd" else [f'optim.name="{name}"']).optim
        params, grads = FlatBuffer(be, layout), FlatBuffer(be, layout)
        optim = make_optimizer(cfg, be, params, grads)
        grads.data[:] = 1e3
        assert optim.overflow() == ("", "", 0.0)
        grads.data[14] = 3e38 if name == "sgd" else 1e21  # in b.weight: Adam's (1 - beta2) d d overflows, SGD's 0.9 m + d
        if name == "sgd":
            optim.slots[slot].data[14] = 3e38
        got = optim.overflow()
        assert got[:2] == ("b.weight", slot) and got[2] >= 1e21, (name, got)


def test_the_overflow_check_reads_each_zero_pieces_own_optimizer_state():
    """Under ZeRO a rank updates several pieces (one chunk per bucket), their optimizer state one after another:
    each piece is checked against its own slots, not the first piece's."""
    from hpctrain.backend import get_backend
    from hpctrain.config import OptimConfig
    from hpctrain.optim import Optimizer
    from hpctrain.params import FlatBuffer, ParamLayout

    be = get_backend("cpu")
    layout = ParamLayout([("a.weight", (16,)), ("b.weight", (16,)), ("c.weight", (16,))])
    params, grads = FlatBuffer(be, layout), FlatBuffer(be, layout)
    optim = Optimizer(OptimConfig(name="sgd", lr=1e-3, momentum=0.9), be, params, grads, pieces=[(32, 48), (0, 16)])
    grads.data[:] = 0.0
    grads.data[0:16] = 3e38  # a.weight, the second piece: its state is slots 16..31
    assert optim.overflow() == ("", "", 0.0)  # 0.9 · 0 + 3e38 is finite
    optim.slots["momentum_buffer"].data[16:] = 3e38  # 0.9 · 3e38 + 3e38 is not
    assert optim.overflow()[:2] == ("a.weight", "momentum_buffer")
    optim.slots["momentum_buffer"].data[:] = 0.0
    optim.slots["momentum_buffer"].data[:16] = 3e38  # the first piece's state (c.weight, whose gradient is 0): finite
    assert optim.overflow() == ("", "", 0.0)


def test_huge_inputs_are_refused_by_the_data_scan(tmp_path, mesh):
    from hpctrain.errors import DataError

    make_classification(tmp_path / "d.h5", n=64)
    import h5py

    with h5py.File(tmp_path / "d.h5", "r+") as f:
        f["x"][17, 2] = 3e25  # finite in float32; its square is not
    with pytest.raises(DataError, match=r"inputs contain a value whose square overflows float32 \(3e\+25 in row 17;"):
        Trainer(config(tmp_path / "d.h5", train={"steps": 3}), mesh=mesh, log=lambda *a: None)


def test_huge_regression_targets_are_refused_by_the_data_scan(tmp_path, mesh):
    """Their squared error overflows float32: named at start-up, not blamed on the optimizer at some step."""
    from helpers import make_regression
    from hpctrain.errors import DataError

    make_regression(tmp_path / "r.h5", n=64, features=6, outputs=3)
    import h5py

    with h5py.File(tmp_path / "r.h5", "r+") as f:
        f["y"][40, 1] = -1e25
    cfg = config(tmp_path / "r.h5", loss="mse", train={"steps": 3},
                 model={"layers": [{"type": "linear", "in": 6, "out": 3}]})
    with pytest.raises(DataError, match=r"targets contain a value whose square overflows float32 \(-1e\+25 in row 40;"):
        Trainer(cfg, mesh=mesh, log=lambda *a: None)


@pytest.mark.parametrize("skip", [False, True], ids=["stop", "skip"])
def test_a_gradient_that_would_overflow_adam_is_found_at_its_step(tmp_path, mesh, monkeypatch, skip):
    """Before: the run trained on with exp_avg_sq = Inf and lost everything at the next checkpoint."""
    make_classification(tmp_path / "d.h5", n=64)
    real = StepRunner._finish

    def huge_gradient_at_step_3(self, step, lr):
        if step == 2:
            self.grads.data[5] = 1e21
        return real(self, step, lr)

    monkeypatch.setattr(StepRunner, "_finish", huge_gradient_at_step_3)
    ck, lines = str(tmp_path / "ck"), []
    cfg = config(tmp_path / "d.h5", optim={"name": "adamw", "lr": 0.01},
                 train={"steps": 5, "skip_nonfinite": skip}, checkpoint={"dir": ck, "every": 1, "async": False})
    t = Trainer(cfg, mesh=mesh, log=lines.append)
    try:
        if skip:
            t.run()
            assert t.step == 5 and t.optim.step_count == 4
            assert any(line.startswith("step 3: the gradient of 0.weight (|g| up to 1e+21) would overflow the "
                                       "optimizer's exp_avg_sq in float32: step skipped") for line in lines), lines
            assert [s for s, _ in list_checkpoints(ck)][-1] == 5  # every checkpoint verifies
        else:
            with pytest.raises(NonFiniteError, match=r"^step 3: the gradient of 0.weight \(\|g\| up to 1e\+21\) would "
                                                     r"overflow the optimizer's exp_avg_sq in float32; lower optim.lr"):
                t.run()
            assert [s for s, _ in list_checkpoints(ck)] == [1, 2]  # the last good checkpoint is kept
    finally:
        t.close()
