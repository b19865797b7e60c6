"""What Slurm says about this job step, held against what MPI says, and the node's cores shared by the ranks on it.

    problem = singleton_world(MPI.COMM_WORLD.Get_size(), os.environ)  # a line, or None
    rank, size = node_local(MPI.COMM_WORLD)                             # this node's ranks, from MPI itself
    threads = share_node_cores(MPI.COMM_WORLD, os.environ)             # the BLAS limit applied (or None)

**Singleton worlds.** ``srun`` starts the tasks; MPI connects them only through the PMI
plugin that both Slurm and the MPI library speak. With the wrong one (``MpiDefault=none``
and an Open MPI 5 or a PMIx-only MPICH) every task initialises MPI alone: N worlds of one
rank, each a complete training run writing the same folder. Slurm's step size
(``SLURM_STEP_NUM_TASKS``, set by ``srun``) against a world of one says so at start-up.
A launcher inside the allocation (``mpirun``, ``mpiexec``) that started one rank on purpose
says so too (``OMPI_COMM_WORLD_SIZE`` / ``PMI_SIZE`` = 1), and is left alone. Outside Slurm the
same mistake is an ``mpiexec`` of another MPI than mpi4py's: its size variable (``PMI_SIZE`` from
MPICH's Hydra and Intel MPI, ``OMPI_COMM_WORLD_SIZE`` from Open MPI) against a world of one.

**Node-local size.** ``MPI.COMM_WORLD.Split_type(COMM_TYPE_SHARED)`` answers for any
launcher; Slurm's ``SLURM_NTASKS_PER_NODE`` exists only with ``--ntasks-per-node``.

**Threads.** ``hpctrain/_threads.py`` sets the BLAS variables before numpy starts, from the
launcher's variables where it can. Once MPI runs, ``share_node_cores`` applies the limit
with threadpoolctl, whatever the import order: the cores this rank is bound to, or the
node's cores over its ranks, unless the user set OMP_NUM_THREADS (or one of the BLAS
variables) or Slurm's ``--cpus-per-task`` says how many.
"""

from __future__ import annotations

import os

__all__ = ["singleton_world", "node_local", "share_node_cores", "same_step", "slurm_view", "SRUN_MPI_HINT"]

SRUN_MPI_HINT = ("start the tasks with srun --mpi=pmix (or --mpi=pmi2; srun --mpi=list shows what this cluster "
                 "offers, and the bundled sbatch scripts take it from HPCTRAIN_SRUN_MPI)")
_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def step_tasks(environ=os.environ) -> int:
    """Tasks in this Slurm job step (0 outside one): ``SLURM_STEP_NUM_TASKS``, which srun sets, else
    ``SLURM_NTASKS`` inside an srun step (``SLURM_STEP_ID`` set); a batch script's own shell counts as none."""
    value = environ.get("SLURM_STEP_NUM_TASKS", "")
    if not value and environ.get("SLURM_STEP_ID", "") not in ("", "batch", "extern"):
        value = environ.get("SLURM_NTASKS", "")
    return int(value) if value.isdigit() else 0


def singleton_world(world_size: int, environ=os.environ) -> str | None:
    """The one-line error when a launcher started several ranks but MPI gave this one a world of its own (srun
    without a PMI the MPI library speaks; an ``mpiexec`` of another MPI than mpi4py's), else None."""
    if world_size != 1:
        return None
    launched = {var: int(environ[var]) for var in _LAUNCHER_SIZE_VARS if environ.get(var, "").isdigit()}
    if 1 in launched.values():
        return None  # mpirun / mpiexec (inside an allocation or not), asked for one rank
    task = _task(environ)
    tasks = step_tasks(environ)
    if tasks > 1:
        step = f"{environ.get('SLURM_JOB_ID', '?')}.{environ.get('SLURM_STEP_ID', '?')}"
        return (f"{task}Slurm started {tasks} tasks in job step {step} but MPI gives this one a world of 1 rank: srun "
                f"and the MPI library did not connect the tasks (no common PMI), so each would train alone; "
                f"{SRUN_MPI_HINT}")
    for var, n in launched.items():
        if n > 1:
            return (f"{task}the launcher started {n} ranks ({var}={n}) but MPI gives this one a world of 1 rank: the "
                    f"launcher belongs to another MPI than the one mpi4py was built with, so each rank would train "
                    f"alone; run that MPI's mpiexec or mpirun (python -m mpi4py --mpi-library names it)")
    return None


def _task(environ) -> str:
    """``task N: `` from the launcher's rank variables (every singleton world is rank 0), else nothing."""
    for var in ("SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if environ.get(var, "").isdigit():
            return f"task {environ[var]}: "
    return ""


def same_step(record: dict, environ=os.environ) -> bool:
    """Whether a lock holder's record (job, step) names this very Slurm job step."""
    job, step = environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_STEP_ID", "")
    return bool(job and step) and record.get("job") == job and record.get("step") == step


def node_local(comm) -> tuple[int, int]:
    """(this rank's index among the ranks on its node, how many there are), from MPI's shared-memory split."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def threads_for(local_size: int, environ=os.environ, *, cores: int | None = None, mine: int | None = None) -> int | None:
    """BLAS threads for a rank with ``local_size`` ranks on its node; None where the user or Slurm decided.

    ``cores``: the node's (os.cpu_count()); ``mine``: the cores this rank may run on (its affinity)."""
    from .._threads import USER_THREAD_VARS

    if USER_THREAD_VARS or environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return None
    cores = cores or os.cpu_count() or 1
    if mine is None:
        mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return mine if mine < cores else max(1, cores // max(1, local_size))  # bound by the launcher: its share


def share_node_cores(comm, environ=os.environ) -> int | None:
    """Apply this rank's share of its node's cores to the running BLAS (threadpoolctl); the limit, or None.

    Collective over ``comm`` (the shared-memory split)."""
    _, size = node_local(comm)
    threads = threads_for(size, environ)
    if threads is None:
        return None
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        environ[name] = str(threads)  # for threads started later (numba's, and child processes)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # an install without it: the variables set before numpy started are all there is
        return threads
    threadpool_limits(threads)
    return threads


def slurm_view(environ=os.environ) -> list[str]:
    """The lines ``hpctrain env`` shows of Slurm's view of this process (none outside Slurm)."""
    if "SLURM_JOB_ID" not in environ:
        return []
    get = environ.get
    job = get("SLURM_JOB_ID") + (f" (array {get('SLURM_ARRAY_JOB_ID')}_{get('SLURM_ARRAY_TASK_ID')})"
                                  if get("SLURM_ARRAY_JOB_ID") else "")
    step = get("SLURM_STEP_ID", "none (the batch script's shell)")
    return [f"Slurm: job {job}, step {step}, {step_tasks(environ) or get('SLURM_NTASKS', '?')} task(s) in the step, "
            f"task {get('SLURM_PROCID', '?')}, node-local task {get('SLURM_LOCALID', '?')}, "
            f"cpus per task {get('SLURM_CPUS_PER_TASK', 'not set')}",
            f"Slurm: PMI plugin {get('SLURM_MPI_TYPE', 'the site default (srun --mpi=list)')}, "
            f"nodes {get('SLURM_JOB_NUM_NODES', get('SLURM_NNODES', '?'))}"]
