"""End the whole job from one rank, without losing that rank's last words.

``COMM_WORLD.Abort`` makes the launcher (Hydra, srun) kill every process at
once. What a rank printed just before is still in the pipe between the rank and
the launcher's forwarder, and a launcher that handles the abort first drops it:
the job dies with no message at all. So before aborting, each rank waits,
briefly and with a deadline, until the launcher has read everything it wrote
to stdout and stderr.
"""

import fcntl
import os
import stat
import struct
import sys
import termios
import time


def _unread_bytes(fd: int) -> int:
    """Bytes still waiting in the pipe on ``fd``; 0 when fd is not a pipe or cannot say."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def drain_stdio(timeout: float = 2.0) -> None:
    """Flush stdout and stderr, then wait until the reader of each pipe has taken it (at most ``timeout`` s)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout
    for fd in (1, 2):
        while _unread_bytes(fd) > 0 and time.monotonic() < deadline:
            time.sleep(0.01)


def started_mpi():
    """mpi4py's MPI module when this process has started MPI (and not finalized it), else None.

    Never starts it: importing ``mpi4py.MPI`` initializes MPI, which under a launcher waits for every rank
    of the job, and a rank of a command that never needed MPI (predict, export) may have left already."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() else None
    except (RuntimeError, OSError):
        return None


def abort_world(code: int) -> None:
    """Abort every rank of the job with ``code`` once this rank's output is out; no-op on one rank, and where
    MPI was never started (nothing to abort: each process ends on its own)."""
    MPI = started_mpi()
    if MPI is not None and MPI.COMM_WORLD.Get_size() > 1:
        drain_stdio()
        MPI.COMM_WORLD.Abort(code)
