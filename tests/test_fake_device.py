"""The device code paths on the CPU: tests/fake_device_worker.py under ``mpiexec -n 2`` trains data parallel,
pipeline, tensor parallel, ZeRO and deterministic layouts on FakeDevice (tests/fake_device.py) with
``parallel.cuda_aware`` true (MPI handed the "device" arrays, which the CUDA simulator cannot do) and false
(staged), and checks the CPU backend's bits and the waits per step."""

import os
import shutil
import subprocess
import sys

import pytest

from launch import launcher_env, mpi_command

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_device_paths_cuda_aware_and_staged_give_the_cpu_bits(tmp_path):
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found: install hpctrain[mpich] or load your site's MPI module")
    env = launcher_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(mpi_command(mpiexec, 2, sys.executable, os.path.join(HERE, "fake_device_worker.py"),
                                      str(tmp_path)), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert output.count(" OK") == 2 * 2 * 7, output[-4000:]  # 2 ranks × (CUDA-aware, staged) × 7 layouts
