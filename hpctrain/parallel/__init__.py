"""Communication: the mesh, start-up agreement, transport, gradient sync, schedules and their executor."""

from .data_parallel import GradSync, make_buckets
from .mesh import Mesh, mpi_cuda_aware, resolve_layout

__all__ = ["Mesh", "resolve_layout", "mpi_cuda_aware", "GradSync", "make_buckets"]
