"""Communication: the mesh, start-up agreement and data-parallel gradient sync."""

from .data_parallel import GradSync, make_buckets
from .mesh import Mesh, mpi_cuda_aware, resolve_layout

__all__ = ["Mesh", "resolve_layout", "mpi_cuda_aware", "GradSync", "make_buckets"]
