"""After a rank dies mid-run (kill -9, or an exception), the job ends within the bound, and
``resume = "auto"`` continues from the last checkpoint to exactly where an uninterrupted run ends:
nothing checkpointed is lost, and what was not yet checkpointed is recomputed bit for bit."""

import os
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from helpers import folder_listing, make_classification, toml_job
from launch import launcher_env, mpi_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")

SCRIPT = """
import os, signal, sys
from mpi4py import MPI
import hpctrain.train.loop as loop
from hpctrain.cli import main

fault = sys.argv[2]
original = loop.Trainer.train_step
def train_step(self, step, *args):
    if fault != "none" and MPI.COMM_WORLD.rank == 1 and step == 7:  # after the step-5 checkpoint
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("rank 1 fell over")
    return original(self, step, *args)
loop.Trainer.train_step = train_step
sys.exit(main(["train", sys.argv[1]]))
"""


def launch(folder, fault):
    env = launcher_env({"PYTHONPATH": ROOT})
    t0 = time.monotonic()
    proc = subprocess.run(mpi_command(MPIEXEC, 2, sys.executable, "-c", SCRIPT, str(folder / "job.toml"), fault),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - t0


def final_params(folder):
    with h5py.File(folder / "ck" / "ckpt-00000012.h5", "r") as f:
        return {k: f["params"][k][()] for k in f["params"]}, int(f.attrs["step"])


@pytest.mark.parametrize("fault", ["kill", "exception"])
def test_a_rank_dying_mid_run_loses_nothing_checkpointed(tmp_path, fault):
    job = toml_job(train={"steps": 12, "log_every": 4}, optim={"name": "adamw", "lr": 0.01},
                   checkpoint={"dir": "ck", "every": 5, "keep": 5, "async": False})  # committed before step 6
    for name in ("whole", "broken"):
        (tmp_path / name).mkdir()
        make_classification(tmp_path / name / "d.h5", n=64)
        (tmp_path / name / "job.toml").write_text(job)
    whole, _ = launch(tmp_path / "whole", "none")
    assert whole.returncode == 0, whole.stderr[-2000:]

    broken, took = launch(tmp_path / "broken", fault)
    assert broken.returncode != 0 and took < 60, broken.stderr[-2000:]
    if fault == "exception":
        assert "hpctrain: error [rank 1/2]: RuntimeError: rank 1 fell over" in broken.stderr
    # the step-5 checkpoint, and the lock the aborted job could not remove (stale: its holder is gone)
    assert folder_listing(tmp_path / "broken" / "ck") == ["ckpt-00000005.h5", "ckpt-00000005.shards", "hpctrain.lock"]

    resumed, _ = launch(tmp_path / "broken", "none")  # resume = "auto" is the default
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout and "at step 5" in resumed.stdout, \
        resumed.stdout + resumed.stderr[-2000:]
    assert "taking over a stale lock" in resumed.stdout
    want, step = final_params(tmp_path / "whole")
    got, step2 = final_params(tmp_path / "broken")
    assert step == step2 == 12
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
