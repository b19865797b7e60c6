"""Launch the multi-rank and CUDA-simulator sub-suites from the one test command."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(cmd, env_extra, timeout):
    env = dict(os.environ, **env_extra)
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    print(output[-6000:])
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{output[-6000:]}"
    assert " passed" in output, f"{' '.join(cmd)} ran no test:\n{output[-3000:]}"


LAYOUT_TESTS = ["tests/mpi/test_pipeline.py", "tests/mpi/test_checkpoint_resharding.py", "tests/mpi/test_gpt_parallel.py",
                "tests/mpi/test_tensor_parallel.py"]


@pytest.mark.parametrize("ranks, tests", [(1, ["tests/mpi"]), (2, ["tests/mpi"]), (3, ["tests/mpi/test_param_server.py"]),
                                          (4, LAYOUT_TESTS + ["tests/mpi/test_param_server.py"])],
                         ids=["1-rank", "2-ranks", "3-ranks-parameter-server", "4-ranks-layouts"])
def test_mpi_suite(ranks, tests):
    """Three ranks run the parameter server (1 server, 2 workers); four (oversubscribed on small machines)
    the tests about layouts: pp 2 x dp 2, pp 4, tp 2 x dp 2, tp 2 x pp 2, and 2 servers + 2 workers."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: install hpctrain[mpich] or load your site's MPI module")
    _run([mpiexec, "-n", str(ranks), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
         {"HPCTRAIN_SUBSUITE": "mpi"}, timeout=900)


def test_cuda_simulator_suite():
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (pip install hpctrain[test])")
    _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cuda"],
         {"HPCTRAIN_SUBSUITE": "cuda", "NUMBA_ENABLE_CUDASIM": "1"}, timeout=900)
