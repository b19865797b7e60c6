"""Start-up agreement: ranks leave together on a bad input instead of hanging.

Each function here is collective over ``comm``: every rank must call it, in
the same order. They use buffer-based MPI calls only (no pickle).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..errors import HpctrainError, LayoutError

__all__ = ["first_failing_rank", "run_everywhere", "check_same_everywhere", "QuietExit"]


class QuietExit(HpctrainError):
    """Another rank failed and reported it; this rank leaves without repeating the message."""

    def __init__(self, rank: int):
        super().__init__(f"rank {rank} reported an error")
        self.rank = rank


def first_failing_rank(comm, failed: bool) -> int:
    """Collective: the lowest rank that passed ``failed=True``, or -1 if none did."""
    from mpi4py import MPI

    size = comm.Get_size()
    value = np.array([comm.Get_rank() if failed else size], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, value, op=MPI.MIN)
    return -1 if value[0] == size else int(value[0])


def run_everywhere(comm, fn):
    """Collective: run ``fn()`` on every rank; if it raised HpctrainError anywhere, raise on every rank.

    The lowest failing rank re-raises its own error (the CLI prints it); the
    others raise QuietExit, so the job prints one message and exits cleanly.

    An error that is already collective (a QuietExit, or the error of an agreement
    nested inside ``fn``) passes straight through: every rank has already taken
    part in the collective that decided it, and a second one would have no partner
    on a rank that failed before reaching the nested agreement.
    """
    try:
        result, error = fn(), None
    except HpctrainError as e:
        if isinstance(e, QuietExit) or getattr(e, "collective", False):
            raise
        result, error = None, e
    bad = first_failing_rank(comm, error is not None)
    if bad < 0:
        return result
    if bad == comm.Get_rank():
        error.collective = True  # every rank knows: no need to abort the job
        raise error
    raise QuietExit(bad)


def _bcast_text(comm, text: str, root: int) -> str:
    data = np.frombuffer(text.encode(), dtype=np.uint8).copy()
    n = np.array([len(data)], dtype=np.int64)
    comm.Bcast(n, root=root)
    buf = data if comm.Get_rank() == root else np.empty(int(n[0]), dtype=np.uint8)
    comm.Bcast(buf, root=root)
    return buf.tobytes().decode(errors="replace")


def check_same_everywhere(comm, what: str, text: str, describe_difference) -> None:
    """Collective: compare the hash of ``text`` with rank 0's; on a mismatch every rank raises LayoutError.

    ``describe_difference(rank0_text)`` runs on the first differing rank and
    names the first difference, which is then broadcast to all.
    """
    mine = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8).copy()
    root = mine.copy()
    comm.Bcast(root, root=0)
    bad = first_failing_rank(comm, not np.array_equal(root, mine))
    if bad < 0:
        return
    rank0_text = _bcast_text(comm, text, 0)
    detail = describe_difference(rank0_text) if comm.Get_rank() == bad else ""
    detail = _bcast_text(comm, detail, bad)
    error = LayoutError(f"rank {bad} has a different {what} from rank 0: {detail}")
    if comm.Get_rank() == 0:
        error.collective = True
        raise error
    raise QuietExit(0)
