"""Share the node's cores between the ranks on it, before numpy's BLAS starts its threads.

Several ranks on one node each starting one BLAS thread per core oversubscribe
the node many times over: the digits job on 2 ranks on 2 cores ran at 1,835 samples/s with
2 BLAS threads per rank against 112,113 with 1 (docs/performance.md has the command).
Where torchrun sets OMP_NUM_THREADS=1, hpctrain gives each rank its share:
OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS = the cores this rank
is bound to, or cores // ranks-on-this-node when it is not bound, when the
launcher tells how many ranks share the node and the user has set none of them. This only works if it
runs before numpy is first imported, so ``hpctrain/__init__.py`` calls it first. Once MPI runs,
``parallel/slurm.share_node_cores`` applies the share again from MPI's own count of the
ranks on the node (threadpoolctl), whatever the launcher and the import order.
"""

import os
import sys

_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "PMI_LOCAL_SIZE")
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# the ones the user set (read when hpctrain is first imported, before this module sets any): their choice stands,
# also when parallel/slurm.py applies the node's share at run time
USER_THREAD_VARS = tuple(v for v in _THREAD_VARS if v in os.environ)


def share_cores_between_local_ranks(environ=os.environ) -> None:
    if any(v in environ for v in _THREAD_VARS):
        return
    for var in _LOCAL_SIZE_VARS:
        value = environ.get(var, "").split("(")[0]  # SLURM_NTASKS_PER_NODE may read "2(x4)"
        if value.isdigit() and int(value) > 1:
            node = os.cpu_count() or 1
            mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else node
            # a launcher that bound this rank to its own cores has already shared the node out
            threads = str(mine if mine < node else max(1, node // int(value)))
            for name in _THREAD_VARS:
                environ[name] = threads
            if "numpy" in sys.modules:  # too late for the variables: BLAS has started its threads
                _limit_running_blas(int(threads))
            return


def _limit_running_blas(threads: int) -> None:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        print(f"hpctrain: warning: numpy was imported before hpctrain, so its BLAS may run more threads than "
              f"this rank's share of the cores; set OMP_NUM_THREADS={threads} or import hpctrain first",
              file=sys.stderr)
        return
    threadpool_limits(threads)
