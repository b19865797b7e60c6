"""Stop signals: SIGTERM and SIGUSR1 recorded, never fatal, from the command line's entry to the process's exit.

Slurm sends SIGUSR1 (``--signal=B:USR1@120``, forwarded by the batch script) before a time limit
and SIGTERM on ``scancel`` or preemption, to every task; MPICH's ``mpiexec`` forwards both to its
ranks. A rank records the signal; the ranks agree on it at the next step boundary (``any_rank``, a
one-int Allreduce) and stop together after a checkpoint.

Why the handlers stay until the process exits: a second signal during the stop checkpoint must not
kill a rank that has done its part (a launcher then kills the rank still writing). The trainer keeps
every rank in a Barrier until world rank 0's write is durable, and a signal after that is recorded
and ignored. While the stop checkpoint is written, SIGINT is recorded too (``shield_interrupts``): a
Ctrl-C then does not lose the checkpoint either; during training it interrupts as usual.

The command line records them from its first instruction: ``hpctrain/__init__.py`` calls ``early()`` when the
process is ``hpctrain train`` (before numpy, mpi4py and MPI's start-up, which took the first second of a run;
a SIGTERM then killed the rank, rc 15). There, SIGINT is a stop signal too: a first Ctrl-C stops the run
at the next step boundary with a checkpoint, exactly like SIGTERM; a second one aborts at once
(KeyboardInterrupt: ``hpctrain: interrupted``, exit 130), as PyTorch Lightning and DeepSpeed users expect.

Open MPI's ``mpirun`` is different: on SIGTERM or SIGINT it kills its ranks itself about half a
second later, whatever they do with the signal. Under it, stop a job with SIGUSR1 (which it forwards)
or signal the ranks themselves, as Slurm does (docs/reliability.md).
"""

from __future__ import annotations

import signal
import threading

__all__ = ["StopFlag"]


class StopFlag:
    """SIGTERM/SIGUSR1 set a flag (``name``); ranks agree on it at each step boundary.

    Installing handlers needs the main thread; elsewhere the flag is inert (nothing sets it).
    ``restore()`` puts the previous handlers back; the command line never calls it.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, *, interrupts: bool = False):
        """``interrupts``: SIGINT is a stop signal too (the command line): the first stops, the second aborts."""
        self.name, self.later, self._old, self.interrupts, self._sigint = "", [], {}, 0, interrupts
        self.install()

    def install(self) -> None:
        """Record SIGTERM and SIGUSR1 (and SIGINT, for the command line) from now on (again, after ``restore``)."""
        for name in self.SIGNALS + (("SIGINT",) if self._sigint else ()):
            self._install(name)

    def _install(self, name: str) -> None:
        sig = getattr(signal, name, None)
        if sig is None or sig in self._old or threading.current_thread() is not threading.main_thread():
            return
        self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        received = signal.Signals(signum).name
        if received == "SIGINT":
            self.interrupts += 1
            if self.interrupts > 1 and self._sigint:  # a second Ctrl-C: abort now, whatever is being done
                raise KeyboardInterrupt
        if self.name:
            self.later.append(received)  # already stopping: recorded, nothing more
        else:
            self.name = received

    def shield_interrupts(self) -> None:
        """From now until ``restore``, SIGINT is recorded like SIGTERM (the stop checkpoint is being written)."""
        self._install("SIGINT")

    def any_rank(self, comm) -> bool:
        """True on every rank when any rank has received a stop signal (collective over ``comm``). A rank that
        received none learns which and where: ``name`` becomes e.g. "SIGTERM (on rank 3)" (the lowest rank
        with the highest-numbered signal, one int64 Allreduce as before)."""
        import numpy as np
        from mpi4py import MPI

        size = comm.Get_size()
        signum = int(getattr(signal, self.name, 0)) if self.name.startswith("SIG") else 0
        flag = np.array([signum * size + (size - 1 - comm.Get_rank()) if signum else 0], dtype=np.int64)
        if size > 1:
            comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
        if flag[0] and not self.name:
            signum, rank = divmod(int(flag[0]), size)
            self.name = f"{signal.Signals(signum).name} (on rank {size - 1 - rank})"
        return bool(flag[0])

    def ignore_until_exit(self) -> None:
        """The command is over: SIGTERM and SIGUSR1 are ignored from here to the process's exit. (Python's
        finalization puts the default, fatal action back on every signal with a Python handler, so a second
        signal while the process exits, after a stop checkpoint, would otherwise kill it: exit status 143 for
        a run that did its part.) SIGINT keeps its action: a Ctrl-C still ends a teardown that hangs."""
        for sig in self._old:
            signal.signal(sig, signal.SIG_IGN if sig != signal.SIGINT else signal.default_int_handler)

    def restore(self) -> None:
        """The handlers there were before this flag (not collective)."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


_EARLY: list = []  # the command line's flag, made by early() at its first instruction


def early() -> StopFlag:
    """The command line's StopFlag (SIGINT included), made once: by ``hpctrain/__init__.py`` when the process is
    ``hpctrain train``, before anything else is imported, or by ``cli.main``."""
    if not _EARLY:
        _EARLY.append(StopFlag(interrupts=True))
    return _EARLY[0]
