"""The explicit mesh: data-, pipeline- and tensor-parallel communicators.

``Mesh`` duplicates ``COMM_WORLD`` (never uses the user's communicator itself)
and splits it into dp × pp × tp groups. Ranks are ordered tensor-parallel
fastest, then data-parallel, then pipeline (as Megatron-core does):

    world rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

Building a Mesh is collective over the world communicator: every rank must
construct it, with the same layout. The layout is checked against the world
size before any collective, so a misfit is an error, not a hang.
"""

from __future__ import annotations

import ctypes
import operator

from ..errors import LayoutError

__all__ = ["Mesh", "resolve_layout", "mpi_cuda_aware"]


def resolve_layout(world_size: int, dp, pp: int, tp: int) -> tuple[int, int, int]:
    """Return (dp, pp, tp) for ``world_size``; ``dp = "auto"`` is world / (pp · tp). LayoutError for sizes that
    are not positive integers (dp may be "auto") or do not multiply to the world size."""
    sizes = {}
    for key, value in (("dp", dp), ("pp", pp), ("tp", tp)):
        if key == "dp" and isinstance(value, str) and value == "auto":
            sizes[key] = value
            continue
        try:
            whole = operator.index(value)  # an int or a numpy integer, not a float or a bool
        except TypeError:
            whole = None
        if whole is None or isinstance(value, bool) or whole < 1:
            raise LayoutError(f"{key} = {value!r} (parallel.{key}): expected a positive integer"
                              + (' or "auto"' if key == "dp" else ""))
        sizes[key] = whole
    dp, pp, tp = sizes["dp"], sizes["pp"], sizes["tp"]
    if world_size % (pp * tp):
        raise LayoutError(f"world size {world_size} is not divisible by parallel.pp · parallel.tp = {pp} · {tp}")
    if dp == "auto":
        dp = world_size // (pp * tp)
    if dp * pp * tp != world_size:
        raise LayoutError(f"parallel.dp · pp · tp = {dp} · {pp} · {tp} = {dp * pp * tp} does not match the "
                          f"world size {world_size} (start {dp * pp * tp} ranks, or set dp = \"auto\")")
    return dp, pp, tp


class Mesh:
    """Communicators for one dp × pp × tp layout. Collective to construct; call ``free()`` when done."""

    def __init__(self, *, dp="auto", pp: int = 1, tp: int = 1, comm=None):
        from mpi4py import MPI

        base = comm if comm is not None else MPI.COMM_WORLD
        if not isinstance(base, MPI.Comm):
            raise LayoutError(f"Mesh(comm=...): expected an mpi4py communicator, got {type(base).__name__}")
        self.dp, self.pp, self.tp = resolve_layout(base.Get_size(), dp, pp, tp)  # local: no collective yet
        self.world = base.Dup()
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.pp_rank, rest = divmod(self.rank, self.dp * self.tp)
        self.dp_rank, self.tp_rank = divmod(rest, self.tp)
        self.dp_comm = self.world.Split(self.pp_rank * self.tp + self.tp_rank, self.rank)
        self.tp_comm = self.world.Split(self.pp_rank * self.dp + self.dp_rank, self.rank)
        # all stages of one (dp, tp) position: pipeline messages, the norm over stages, checkpoint gathers
        self.pp_comm = self.world.Split(self.dp_rank * self.tp + self.tp_rank, self.rank)
        # first and last stage of one (dp, tp) position, for weights tied across them (an embedding and its
        # head); COMM_NULL on the stages between
        ends = self.pp_rank in (0, self.pp - 1)
        self.ends_comm = self.world.Split(self.dp_rank * self.tp + self.tp_rank if ends else MPI.UNDEFINED, self.rank)

    @property
    def layout(self) -> dict:
        return {"world_size": self.size, "dp": self.dp, "pp": self.pp, "tp": self.tp}

    def describe(self) -> str:
        return f"world {self.size} = dp {self.dp} x pp {self.pp} x tp {self.tp}"

    def watch(self, diag) -> None:
        """Route every collective on this mesh's communicators through ``diag`` (parallel/watch.py)."""
        for attr in ("world", "dp_comm", "tp_comm", "pp_comm", "ends_comm"):
            setattr(self, attr, diag.wrap(getattr(self, attr), attr.removesuffix("_comm")))

    def free(self) -> None:
        from mpi4py import MPI

        for comm in (self.dp_comm, self.tp_comm, self.pp_comm, self.ends_comm, self.world):
            if comm != MPI.COMM_NULL:
                comm.Free()


def mpi_function(name: str):
    """The MPI library's C function ``name`` (a ctypes function), or None where the library lacks it.

    Looked up through mpi4py's extension module, which links the MPI library: libmpi is loaded
    with local symbols, so the process-wide namespace (``ctypes.CDLL(None)``) does not see it.
    """
    from mpi4py import MPI

    for path in (MPI.__file__, None):
        try:
            return getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
    return None


def mpi_cuda_aware() -> bool:
    """Ask the MPI library whether it takes CUDA device buffers; False when it has no way to say.

    Open MPI: ``MPIX_Query_cuda_support()``. MPICH >= 4: ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &ok)``.
    """
    fn = mpi_function("MPIX_Query_cuda_support")
    if fn is not None:
        fn.restype = ctypes.c_int
        if fn():
            return True
    fn = mpi_function("MPIX_GPU_query_support")
    if fn is not None:
        ok = ctypes.c_int(0)
        if fn(ctypes.c_int(0), ctypes.byref(ok)) == 0:  # MPIX_GPU_SUPPORT_CUDA == 0
            return bool(ok.value)
    return False
