"""tests/launch.py's rule for reading hpctrain's lines out of a failed job's output (``hpctrain_lines``).

The samples are what each launcher printed here when a rank of a 2-rank job exited 2, was killed or
called MPI_Abort (Open MPI 5.0.11's prterun, MPICH 5.0.2's Hydra); the last tests make a rank fail under
the launchers installed now, so a launcher whose text has changed fails here and not in a one-line check.
"""

import os
import shutil
import subprocess
import sys

import pytest

from launch import hpctrain_lines, launcher_env, mpi_command, open_mpi_python_for_a_rerun, stop_signal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULE = "-" * 74
HYDRA_RULE = "=" * 83

OPEN_MPI_NON_ZERO_EXIT = f"""{RULE}
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-9839@1,1]
   Exit code:    2
{RULE}
"""

OPEN_MPI_SIGNAL = f"""{RULE}
prterun noticed that process rank 1 with PID 13016 on node vm exited on
signal 9 (Killed).
{RULE}
"""

OPEN_MPI_ABORT = f"""{RULE}
MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD
  Proc: [[54359,1],1]
  Errorcode: 2

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
You may or may not see output from other processes, depending on
exactly when Open MPI kills them.
{RULE}
{RULE}
prterun has exited due to process rank 1 with PID 0 on node vm calling
"abort". This may have caused other processes in the application to be
terminated by signals sent by prterun (as reported here).
{RULE}
\0"""

OPEN_MPI_PMIX_ERROR = f"""{RULE}
[vm:29668] PMIX ERROR: PMIX_ERR_UNREACH in file /openmpi-5.0.11/3rd-party/openpmix/src/server/pmix_server.c at line 3146
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-29668@1,1]
   Exit code:    2
{RULE}
"""

PMIX_ERROR_ALONE = ("[vm:29668] PMIX ERROR: PMIX_ERR_UNREACH in file "
                    "/openmpi-5.0.11/3rd-party/openpmix/src/server/pmix_server.c at line 3146\n")

HYDRA_BAD_TERMINATION = f"""
{HYDRA_RULE}
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 25472 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
{HYDRA_RULE}
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
This typically refers to a problem with your application.
Please see the FAQ page for debugging suggestions
"""

MPICH_ABORT = "Abort(2) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 2) - process 1\n"

SAMPLES = {"open-mpi-exit": OPEN_MPI_NON_ZERO_EXIT, "open-mpi-signal": OPEN_MPI_SIGNAL, "open-mpi-abort": OPEN_MPI_ABORT,
           "open-mpi-pmix-error": OPEN_MPI_PMIX_ERROR, "pmix-error": PMIX_ERROR_ALONE,
           "mpich-bad-termination": HYDRA_BAD_TERMINATION, "mpich-abort": MPICH_ABORT}
ERROR = "hpctrain: error [rank 1/2]: RuntimeError: disk on fire"


@pytest.mark.parametrize("sample", SAMPLES.values(), ids=SAMPLES.keys())
def test_a_launchers_report_is_removed_and_hpctrains_line_kept(sample):
    assert hpctrain_lines(sample) == []
    assert hpctrain_lines(f"{ERROR}\n{sample}") == [ERROR]


@pytest.mark.parametrize("sample", SAMPLES.values(), ids=SAMPLES.keys())
def test_hpctrains_lines_around_a_launchers_report_are_all_kept(sample):
    before, after = ["hpctrain: world 2 = dp 2 x pp 1 x tp 1", ""], ["step 3 loss 0.5", "", "done"]
    assert hpctrain_lines("\n".join(before) + "\n" + sample + "\n".join(after) + "\n") == before + after


def test_a_box_left_open_runs_to_the_end():
    """prterun killed while it wrote its message: what follows the opening rule is all the launcher's."""
    assert hpctrain_lines(f"{ERROR}\n{RULE}\nprterun noticed that process rank 1 with PID 13016 on node vm") == [ERROR]


@pytest.mark.parametrize("line", [
    "-" * 73, "-" * 75, "=" * 82, "=   not between Hydra's rules", "", "   ", "Abort at step 3",
    "PMIX ERROR: said without a launcher's [host:pid]", "hpctrain: error: Process name: [prterun-vm-1@1,1]",
])
def test_lines_that_only_look_like_a_launchers_are_kept(line):
    assert hpctrain_lines(f"{ERROR}\n{line}\n") == [ERROR, line]


# a rank of a 2-rank job says one line on stderr, then either exits 2, as hpctrain's main does after an
# error every rank agreed on (the other rank exits 2 without a word), or is killed (the other waits)
FAILING_RANK = """
import os, signal, sys
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.rank == 1:
    print("hpctrain: error [rank 1/2]: RuntimeError: disk on fire", file=sys.stderr, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
elif sys.argv[1] == "kill":
    MPI.COMM_WORLD.Barrier()
sys.exit(2)
"""


def _failing_job(launcher, python, how):
    """Run FAILING_RANK on 2 ranks; its (stdout, stderr)."""
    path = os.path.dirname(python) + os.pathsep + os.environ.get("PATH", "")
    proc = subprocess.run(mpi_command(launcher, 2, python, "-c", FAILING_RANK, how), cwd=ROOT,
                          env=launcher_env({"PATH": path}), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    return proc.stdout, proc.stderr


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install hpctrain[mpich])")
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_the_rule_reads_a_failed_job_under_the_mpiexec_on_path(how):
    stdout, stderr = _failing_job(shutil.which("mpiexec"), sys.executable, how)
    assert hpctrain_lines(stderr) == [ERROR] and hpctrain_lines(stdout) == [], stdout + stderr


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_the_rule_reads_a_failed_job_under_open_mpi(how):
    python = open_mpi_python_for_a_rerun()
    stdout, stderr = _failing_job(os.path.join(os.path.dirname(python), "mpirun"), python, how)
    assert stderr.startswith(ERROR + "\n") and len(stderr.splitlines()) > 1, stderr  # prterun's box follows
    assert hpctrain_lines(stderr) == [ERROR] and hpctrain_lines(stdout) == [], stdout + stderr


def test_the_stop_signal_is_the_one_the_docs_give_for_each_launcher():
    """docs/reliability.md: SIGTERM to MPICH's mpiexec, SIGUSR1 to Open MPI's mpirun (its SIGTERM kills the ranks)."""
    import signal

    assert stop_signal("mpich") == signal.SIGTERM and stop_signal("openmpi") == signal.SIGUSR1
