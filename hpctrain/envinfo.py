"""``hpctrain env``: what this machine gives hpctrain, for bug reports and for checking a cluster setup.

Versions of hpctrain and its dependencies, the MPI library and the thread level it grants,
whether it is CUDA-aware, the GPUs numba sees, the backend ``auto`` would pick, and the BLAS
numpy uses with its threads. Each line is gathered on its own: one that fails says why and
the rest still print.
"""

from __future__ import annotations

import os
import platform
import sys

__all__ = ["report"]


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except ImportError:
        return "not installed"
    return str(getattr(mod, "__version__", "installed"))


def _numba_cuda() -> str:
    try:
        from importlib.metadata import version

        return version("numba-cuda")
    except Exception:
        return "not installed"


def _mpi() -> list[str]:
    from mpi4py import MPI

    from .parallel.mesh import mpi_cuda_aware

    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
              MPI.THREAD_MULTIPLE: "multiple"}
    library = " ".join(MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].split())
    return [f"MPI library: {library}",
            f"MPI standard {'.'.join(map(str, MPI.Get_version()))}, thread level {levels.get(MPI.Query_thread(), '?')}, "
            f"world size {MPI.COMM_WORLD.Get_size()}",
            f"CUDA-aware MPI: {'yes' if mpi_cuda_aware() else 'no (device arrays are staged through host memory)'}"]


def _slurm() -> list[str]:
    from mpi4py import MPI

    from .parallel.slurm import node_local, singleton_world, slurm_view

    lines = slurm_view()
    rank, size = node_local(MPI.COMM_WORLD)
    lines.append(f"node-local: rank {rank} of {size} on this node (MPI's shared-memory split)")
    problem = singleton_world(MPI.COMM_WORLD.Get_size())
    return lines + ([f"launch problem: {problem}"] if problem else [])


def _gpus() -> list[str]:
    from .backend import cuda_available

    if not cuda_available():
        return ["GPUs: none seen (backend auto: cpu)"]
    from numba import cuda

    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in cuda.list_devices()]
    return [f"GPUs: {len(names)}: {', '.join(names)} (backend auto: cuda)"]


def _blas() -> list[str]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        import numpy

        threads = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
                   if k in os.environ}
        blas = numpy.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
        return [f"BLAS: {blas.get('name', '?')} {blas.get('version', '')} (numpy's); thread variables: "
                f"{threads or 'none set (BLAS picks; hpctrain shares the cores between local ranks)'}"]
    import numpy  # noqa: F401  (loads its BLAS)

    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    return [f"BLAS: {p.get('internal_api')} {p.get('version')}, {p.get('num_threads')} thread(s)" for p in pools] \
        or ["BLAS: none found"]


def report() -> str:
    """The lines ``hpctrain env`` prints."""
    import hpctrain

    lines = [f"hpctrain {hpctrain.__version__} ({os.path.dirname(os.path.abspath(hpctrain.__file__))})",
             f"Python {platform.python_version()} ({sys.executable}), {platform.platform()}",
             "packages: " + ", ".join(f"{m} {_version(m)}" for m in ("numpy", "numba", "mpi4py", "h5py"))
             + f", numba-cuda {_numba_cuda()}",
             f"cores: {os.cpu_count()}, this process may use {len(os.sched_getaffinity(0))}"
             if hasattr(os, "sched_getaffinity") else f"cores: {os.cpu_count()}"]
    for part in (_mpi, _slurm, _gpus, _blas):
        try:
            lines += part()
        except Exception as e:  # one failing probe must not hide the others
            lines.append(f"{part.__name__.strip('_')}: could not be checked ({type(e).__name__}: {e})")
    return "\n".join(lines)
