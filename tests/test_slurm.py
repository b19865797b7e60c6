"""hpctrain/parallel/slurm.py: Slurm's view against MPI's (singleton worlds, the lock's "same step"), the node's
cores shared by its ranks at run time, and what `hpctrain env` shows."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from hpctrain.checkpoint.lock import FolderLock
from hpctrain.errors import CheckpointInUseError
from hpctrain.parallel import slurm
from launch import launcher_env, mpi_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
STEP = {"SLURM_JOB_ID": "777", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"}


@pytest.mark.parametrize("world, env, bad", [
    (1, STEP, "slurm"),                                                 # srun without a common PMI
    (4, STEP, None),                                                    # connected
    (1, dict(STEP, SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1"), None),  # srun -n 1
    (1, {"SLURM_JOB_ID": "777", "SLURM_NTASKS": "4"}, None),            # the batch script's own shell
    (1, {"SLURM_JOB_ID": "777", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}, "slurm"),  # no SLURM_STEP_NUM_TASKS
    (1, dict(STEP, OMPI_COMM_WORLD_SIZE="1"), None),                    # mpirun -n 1 inside the allocation
    (1, dict(STEP, PMI_SIZE="1"), None),                                # mpiexec -n 1 inside the allocation
    (1, dict(STEP, PMI_SIZE="4"), "slurm"),                             # PMI says 4, MPI did not use it
    (1, {}, None),                                                      # no Slurm, no launcher
    (1, {"PMI_SIZE": "1", "PMI_RANK": "0"}, None),                      # mpiexec -n 1
    (1, {"PMI_SIZE": "2", "PMI_RANK": "1"}, "launcher"),                # MPICH's mpiexec, Open MPI's mpi4py
    (1, {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2"}, "launcher"),  # and the other way round
    (2, {"PMI_SIZE": "2", "PMI_RANK": "1"}, None),                      # connected
])
def test_singleton_world(world, env, bad):
    problem = slurm.singleton_world(world, env)
    assert (problem is not None) == (bad is not None)
    if problem:
        assert "\n" not in problem
    if bad == "slurm":
        assert "Slurm started 4 tasks in job step 777.0" in problem and "srun --mpi=pmix" in problem
        assert problem.startswith("task ") == ("SLURM_PROCID" in env)
    if bad == "launcher":
        rank = env.get("PMI_RANK") or env.get("OMPI_COMM_WORLD_RANK")
        size = env.get("PMI_SIZE") or env.get("OMPI_COMM_WORLD_SIZE")
        assert problem.startswith(f"task {rank}: the launcher started {size} ranks (")
        assert "another MPI than the one mpi4py was built with" in problem


def test_a_singleton_of_slurm_names_its_task():
    problem = slurm.singleton_world(1, dict(STEP, SLURM_PROCID="3"))
    assert problem.startswith("task 3: Slurm started 4 tasks in job step 777.0")


def test_a_lock_held_by_the_same_job_step_says_so(tmp_path, monkeypatch):
    """Two singleton worlds of one step meet at the checkpoint folder's lock: that message names the cause too."""
    for k, v in STEP.items():
        monkeypatch.setenv(k, v)
    held = FolderLock.take(str(tmp_path / "ck"), log=print)
    try:
        with pytest.raises(CheckpointInUseError, match=r"a task of this same job step: .* srun --mpi=pmix"):
            FolderLock.take(str(tmp_path / "ck"), log=print)
        monkeypatch.setenv("SLURM_STEP_ID", "1")  # another step of the job: the usual message
        with pytest.raises(CheckpointInUseError, match="only one job may use a checkpoint folder at a time"):
            FolderLock.take(str(tmp_path / "ck"), log=print)
    finally:
        held.release()


@pytest.mark.parametrize("local, env, cores, mine, want", [
    (2, {}, 8, 8, 4),                               # unbound: the node's cores over its ranks
    (3, {}, 8, 8, 2),
    (16, {}, 8, 8, 1),                              # oversubscribed: at least one
    (2, {}, 8, 3, 3),                               # bound by the launcher: its cores
    (2, {"SLURM_CPUS_PER_TASK": "2"}, 8, 8, None),  # Slurm decided (the sbatch scripts export the variables)
])
def test_threads_for(local, env, cores, mine, want, monkeypatch):
    monkeypatch.setattr("hpctrain._threads.USER_THREAD_VARS", ())
    assert slurm.threads_for(local, env, cores=cores, mine=mine) == want


def test_threads_for_leaves_a_users_choice_alone(monkeypatch):
    monkeypatch.setattr("hpctrain._threads.USER_THREAD_VARS", ("OMP_NUM_THREADS",))
    assert slurm.threads_for(2, {}, cores=8, mine=8) is None


def test_slurm_view_lines():
    env = dict(STEP, SLURM_ARRAY_JOB_ID="770", SLURM_ARRAY_TASK_ID="7", SLURM_PROCID="2", SLURM_LOCALID="0",
               SLURM_CPUS_PER_TASK="2", SLURM_MPI_TYPE="pmix", SLURM_JOB_NUM_NODES="2")
    lines = slurm.slurm_view(env)
    assert lines[0].startswith("Slurm: job 777 (array 770_7), step 0, 4 task(s) in the step, task 2")
    assert "PMI plugin pmix" in lines[1] and "nodes 2" in lines[1]
    assert slurm.slurm_view({}) == []


SHARE = """
import os
for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "PMI_LOCAL_SIZE"):
    os.environ.pop(var, None)  # as under srun without --ntasks-per-node: no variable tells the local size
import numpy  # first, as a user's script would: BLAS has started its threads
from mpi4py import MPI
from threadpoolctl import threadpool_info
from hpctrain.parallel.slurm import node_local, share_node_cores
rank, size = node_local(MPI.COMM_WORLD)
limit = share_node_cores(MPI.COMM_WORLD)
blas = sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})
import sys
sys.stdout.write(f"local {rank}/{size} limit {limit} blas {blas}\\n")  # one write: two ranks share the pipe
sys.stdout.flush()
"""


@needs_mpiexec
def test_blas_threads_are_limited_after_numpy_was_imported_first():
    """Under mpiexec -n 2 on one node, with no launcher variable naming the local size: MPI's shared-memory
    split counts 2 local ranks, and threadpoolctl applies the node's cores / 2 to the BLAS numpy already started."""
    env = {k: v for k, v in launcher_env().items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "SLURM_CPUS_PER_TASK")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run(mpi_command(MPIEXEC, 2, sys.executable, "-c", SHARE), env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = max(1, (os.cpu_count() or 1) // 2)
    lines = sorted(re.findall(r"local \d/\d limit \S+ blas \[[\d, ]*\]", proc.stdout))
    assert lines == [f"local 0/2 limit {want} blas [{want}]", f"local 1/2 limit {want} blas [{want}]"], proc.stdout
