"""Data parallel, a two-stage pipeline (an MLP and a GPT with its tied embedding) and tensor parallelism on two
ranks with the CUDA backend: same result as the CPU backend, same weights on every data-parallel rank. Runs tests/cuda/dp_worker.py under ``mpiexec -n 2`` (the test itself
is one process)."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for launch.py
from cudatest import SIM  # noqa: E402
from launch import launcher_env, mpi_command  # noqa: E402


ON_A_GPU = pytest.mark.skipif(SIM, reason="needs a real GPU: CUDA's virtual memory management, an 8.5 M model")


@pytest.mark.parametrize("layout", ["dp", "pp", "gpt-pp", "il", "tp", "gpt-tp", "zero", "gpt-det", "memory", "waits-dp",
                                    "waits-zero", "waits-det", "waits-pp", "waits-gpt-pp", "waits-tp",
                                    "arena-dp", "arena-pp-1f1b", "arena-pp-zero-bubble", "arena-tp", "arena-zero2",
                                    pytest.param("zero-release", marks=ON_A_GPU)])
def test_two_ranks_cuda_matches_cpu(tmp_path, layout):
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found: install hpctrain[mpich] or load your site's MPI module")
    # this process may be an MPI singleton already: do not pass its PMI settings to the new job
    env = launcher_env()  # the user's MPI settings pass, what placed this process does not (tests/launch.py)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(mpi_command(mpiexec, 2, sys.executable, os.path.join(HERE, "dp_worker.py"),
                                      str(tmp_path / "d.h5"), layout), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    said = "\n".join(line for line in output.splitlines() if line.startswith("rank "))  # above numba's warnings
    assert proc.returncode == 0, said + "\n" + output[-4000:]
    assert output.count("OK") == 2, said + "\n" + output[-4000:]
