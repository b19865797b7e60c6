"""A failure on one rank ends the whole job with that rank's message, never a hang."""

import os
import shutil
import subprocess
import sys

import pytest

from helpers import make_classification, toml_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")

# rank 1 raises in its third step while rank 0 goes on into the gradient Allreduce
SCRIPT = """
import sys
from mpi4py import MPI
import hpctrain.train as train
from hpctrain.cli import main

original = train.Trainer._train_step
def failing(self, step, *args):
    if MPI.COMM_WORLD.rank == 1 and step == 2:
        raise RuntimeError("disk on fire")
    return original(self, step, *args)
train.Trainer._train_step = failing
sys.exit(main(["train", sys.argv[1]]))
"""

CONFIG = toml_job(train={"steps": 50})


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_exception_on_one_rank_aborts_the_job(tmp_path):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "c.toml").write_text(CONFIG)
    (tmp_path / "fail.py").write_text(SCRIPT)
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(tmp_path / "fail.py"), str(tmp_path / "c.toml")],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "hpctrain: error [rank 1/2]: RuntimeError: disk on fire" in proc.stderr, proc.stderr
