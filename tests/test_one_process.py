"""One-process commands under a launcher (issue 52, item 8): every rank runs them, and an error says so.

``sample``, ``inspect`` and ``config`` printed their error once per rank without the note that ``export``,
``predict``, ``data`` and ``plot`` add; now each of them does, under MPICH's ``mpiexec`` and Open MPI's ``mpirun``.
"""

import os
import shutil
import subprocess
import sys

import pytest

from launch import hpctrain_lines, launcher_env, mpi_command, open_mpi_python_for_a_rerun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {
    "sample": ["sample", "missing.h5", "--prompt", "a"],
    "inspect": ["inspect", "missing.h5"],
    "config": ["config", "missing.toml"],
}


def _launched(python, launcher, args, cwd):
    env = launcher_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return subprocess.run(mpi_command(launcher, 2, python, "-m", "hpctrain", *args), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _check(proc, command):
    lines = [line for line in hpctrain_lines(proc.stderr) if line.startswith("hpctrain: error")]
    # each rank says it (Open MPI's mpirun may end the second rank before it does, as the first exits with 2)
    assert proc.returncode == 2 and 1 <= len(lines) <= 2, proc.stderr
    note = f"(hpctrain {command} runs in one process; the launcher started 2, and each ran it)"
    assert all(line.endswith(note) for line in lines), lines


@pytest.mark.parametrize("command", list(COMMANDS))
def test_under_mpiexec_a_one_process_command_says_every_rank_ran_it(tmp_path, command):
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    _check(_launched(sys.executable, mpiexec, COMMANDS[command], tmp_path), command)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_under_open_mpi_a_one_process_command_says_every_rank_ran_it(tmp_path, command):
    python = open_mpi_python_for_a_rerun()
    _check(_launched(python, os.path.join(os.path.dirname(python), "mpirun"), COMMANDS[command], tmp_path), command)


def test_alone_a_one_process_command_adds_no_note(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "inspect", "missing.h5"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=launcher_env())
    assert proc.returncode == 2 and "runs in one process" not in proc.stderr and proc.stderr.count("\n") == 1
