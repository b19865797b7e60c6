"""Start-up agreement: ranks leave together on a bad input instead of hanging.

Each function here is collective over ``comm``: every rank must call it, in
the same order. They use buffer-based MPI calls only (no pickle).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..errors import HpctrainError, LayoutError

__all__ = ["first_failing_rank", "run_everywhere", "check_same_everywhere", "QuietExit", "bcast_text", "gather_text",
           "agree_error", "raise_agreed"]


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
    """Collective: run ``fn()`` on every rank; if it raised anywhere, raise on every rank.

    The lowest failing rank re-raises its own error (the CLI prints it); the
    others raise QuietExit, so the job prints one message and exits cleanly. Any
    Exception counts, a bug included: one rank's AttributeError must not leave the
    others waiting in the next collective (KeyboardInterrupt and SystemExit pass).

    An error that is already collective (a QuietExit, or the error of an agreement
    nested inside ``fn``) passes straight through: every rank has already taken
    part in the collective that decided it, and a second one would have no partner
    on a rank that failed before reaching the nested agreement.
    """
    try:
        result, error = fn(), None
    except Exception as e:  # noqa: BLE001 -- agreed on, then re-raised on the rank that failed
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


def bcast_text(comm, text: str | None, root: int) -> str:
    """Collective: ``text`` as given on ``root``, on every rank (buffer calls)."""
    text = text if comm.Get_rank() == root else ""
    data = np.frombuffer(text.encode("utf-8", "backslashreplace"), dtype=np.uint8).copy()
    n = np.array([len(data)], dtype=np.int64)
    comm.Bcast(n, root=root)
    buf = data if comm.Get_rank() == root else np.empty(int(n[0]), dtype=np.uint8)
    comm.Bcast(buf, root=root)
    return buf.tobytes().decode(errors="replace")


def check_same_everywhere(comm, what: str, text: str, describe_difference=None) -> None:
    """Collective: compare the hash of ``text`` with rank 0's; on a mismatch every rank raises LayoutError.

    ``describe_difference(rank0_text)`` runs on the first differing rank and
    names the first difference, which is then broadcast to all (default: the first line that differs).
    """
    if describe_difference is None:
        describe_difference = lambda theirs: _first_line_diff(text, theirs)  # noqa: E731
    mine = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8).copy()
    root = mine.copy()
    comm.Bcast(root, root=0)
    bad = first_failing_rank(comm, not np.array_equal(root, mine))
    if bad < 0:
        return
    rank0_text = bcast_text(comm, text, 0)
    detail = describe_difference(rank0_text) if comm.Get_rank() == bad else ""
    detail = bcast_text(comm, detail, bad)
    error = LayoutError(f"rank {bad} has a different {what} from rank 0: {detail}")
    if comm.Get_rank() == 0:
        error.collective = True
        raise error
    raise QuietExit(0)


def _first_line_diff(mine: str, theirs: str) -> str:
    for a, b in zip(mine.splitlines(), theirs.splitlines()):
        if a != b:
            return f"{a!r} here, {b!r} on rank 0"
    return "different length"


def gather_text(comm, text: str) -> list[str] | None:
    """Collective: every rank's ``text`` on rank 0 (Gatherv of UTF-8 bytes), None elsewhere."""
    from mpi4py import MPI

    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64) if comm.Get_rank() == 0 else None
    comm.Gather(np.array([data.size], dtype=np.int64), sizes, root=0)
    if comm.Get_rank() != 0:
        comm.Gatherv(data, None, root=0)
        return None
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    comm.Gatherv(data, [out, sizes, displs, MPI.BYTE], root=0)
    return [out[a : a + n].tobytes().decode("utf-8") for a, n in zip(displs, sizes)]


def agree_error(comm, error: HpctrainError | None) -> tuple[int, HpctrainError | None]:
    """Collective: the lowest failing rank and its error rebuilt alike on every rank (the same class from
    hpctrain.errors, looked up by name, and message), so every rank can decide the same way; (-1, None) when no
    rank failed."""
    from .. import errors

    bad = first_failing_rank(comm, error is not None)
    if bad < 0:
        return -1, None
    mine = f"{type(error).__name__}:{error}" if comm.Get_rank() == bad else None
    name, _, message = bcast_text(comm, mine, bad).partition(":")
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, HpctrainError)):
        cls = HpctrainError  # a class of its own (a test's): the message still says what happened
    return bad, cls(message)


def raise_agreed(comm, bad: int, error: HpctrainError):
    """After ``agree_error``: the failing rank raises the error (the command line prints it), the others leave
    quietly."""
    if comm.Get_rank() == bad:
        error.collective = True  # every rank knows: no need to abort the job
        raise error
    raise QuietExit(bad)
