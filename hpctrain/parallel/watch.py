"""Collective diagnostics: fingerprints that catch ranks calling different collectives, a watchdog for hangs.

    [train]
    debug_collectives = true      # or HPCTRAIN_DEBUG_COLLECTIVES=1
    collective_timeout = 60       # seconds; 0 (the default) is off

A rank that skips a collective, or calls another one, does not fail in MPI: the
next collectives pair up wrongly and the job hangs or computes garbage. A rank that
is stopped (SIGSTOP, a node swapping) leaves the others waiting for ever. Both
are silent. With either setting on, the trainer wraps its communicators in
``WatchedComm`` (``Diagnostics.wrap``), which sees every blocking and non-blocking
collective the job calls (through the proxy, so the call sites stay as they are):

* **fingerprints** (``debug_collectives``): before each collective, the ranks of its
  communicator Allgather a fixed-size record of it (operation, its sequence number on
  that communicator, dtype and count, root, the call site) over a duplicate of the
  communicator, and compare. When they disagree, the lowest rank prints one line
  giving each rank's record and aborts the job (exit status 1).
  Point-to-point messages are fingerprinted by ``transport.PointToPoint``: each send
  is preceded by its record on a duplicate communicator, which the receiver checks
  before it takes the data. Costs an Allgather per collective: a debugging tool.
* **watchdog** (``collective_timeout``): each rank notes the MPI call it is in and the
  last one it finished; a thread on each rank sends that to world rank 0 every
  ``timeout / 5`` seconds (a duplicate of the world communicator, point-to-point, so
  it needs MPI_THREAD_MULTIPLE). When a rank has been inside one MPI call for longer
  than the timeout, or a rank has sent nothing for that long (stopped, or its process
  hung outside Python), rank 0 prints one line naming every rank's state: the silent
  ones first, then those in no MPI call while others wait in one (stuck in their own
  code: the likely cause), then the stuck ones, and aborts the job (exit status 1). If rank 0 itself
  is the one that went silent, every other rank aborts on its own after twice the timeout.

Off (both settings at their defaults), nothing here is created: the communicators are
the plain mpi4py ones.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from ..errors import HpctrainError

__all__ = ["Diagnostics", "WatchedComm", "enabled_by_env", "call_site", "end_job", "pack_record", "unpack_record"]

RECORD = 240  # bytes of a fingerprint or heartbeat record
# the collectives a WatchedComm records: name -> position of the buffer argument whose dtype and count
# every rank shares (None: the counts may differ by rank, as in Gatherv; then only the call is compared)
COLLECTIVES = {
    "Allreduce": 1, "Iallreduce": 1, "Bcast": 0, "Ibcast": 0, "Reduce": 1, "Allgather": 0, "Barrier": None,
    "Gather": None, "Gatherv": None, "Scatter": None, "Scatterv": None, "Alltoall": 0,
}


def enabled_by_env(environ=os.environ) -> bool:
    return environ.get("HPCTRAIN_DEBUG_COLLECTIVES", "") not in ("", "0")


def call_site(depth: int) -> str:
    """``file:line (function)`` of the first frame ``depth`` up that is not in this module."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def describe_buffer(buf) -> str:
    """``dtype×count`` of an mpi4py buffer argument (numpy or device array, or a [buf, ...] spec)."""
    if isinstance(buf, (list, tuple)) and buf:
        buf = buf[0]
    if buf is None:
        return "-"
    if hasattr(buf, "dtype") and hasattr(buf, "size"):
        return f"{np.dtype(buf.dtype).name}x{int(buf.size)}"
    return type(buf).__name__


def pack_record(text: str) -> np.ndarray:
    raw = text.encode("utf-8", "replace")[:RECORD]
    out = np.zeros(RECORD, dtype=np.uint8)
    out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def unpack_record(arr: np.ndarray) -> str:
    return arr.tobytes().rstrip(b"\0").decode("utf-8", "replace")


class Diagnostics:
    """One rank's diagnostics for one job: fingerprints, the watchdog, the record of its MPI calls.

    Collective over ``world`` to construct (with a timeout it duplicates it). ``close()`` is not
    collective (it runs on an error path too, where the other ranks are elsewhere): it stops the
    watchdog and frees the duplicates. ``wrap(comm, name)`` returns ``comm`` watched (COMM_NULL as it is)."""

    def __init__(self, world, *, fingerprints: bool, timeout: float):
        from mpi4py import MPI

        self.MPI = MPI
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.fingerprints, self.timeout = bool(fingerprints), float(timeout)
        self._lock = threading.Lock()
        self._calls = {}  # thread id -> (description, start time) of the MPI call it is in
        self.last = "none yet"  # the last MPI call this rank finished
        self.step = None
        self._monitor = None
        self._wrapped = []  # the WatchedComms made here, whose duplicates close() frees
        if self.timeout > 0:
            if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
                raise HpctrainError("train.collective_timeout needs an MPI library initialised with "
                                    "MPI_THREAD_MULTIPLE (its watchdog thread talks to rank 0 while training runs)")
            self._monitor = _Monitor(self, world.Dup())

    def wrap(self, comm, name: str):
        if comm == self.MPI.COMM_NULL:
            return comm
        if isinstance(comm, WatchedComm):
            comm = comm.comm  # watched by earlier diagnostics: watch the plain one here
        watched = WatchedComm(comm, name, self)
        self._wrapped.append(watched)
        return watched

    # ------------------------------------------------------------------ what this rank is doing

    def begin(self, what: str) -> None:
        with self._lock:
            self._calls[threading.get_ident()] = (what, time.monotonic())

    def end(self) -> None:
        with self._lock:
            what, _ = self._calls.pop(threading.get_ident(), ("?", 0.0))
            self.last = what

    def state(self) -> tuple[str, float]:
        """(one phrase, seconds in the oldest MPI call now in progress, 0 when none)."""
        now = time.monotonic()
        with self._lock:
            calls = sorted(self._calls.values(), key=lambda c: c[1])
            last = self.last
        where = f"step {self.step}, " if self.step is not None else ""
        if calls:
            what, t0 = calls[0]
            return f"{where}in {what} for {now - t0:.1f} s", now - t0
        return f"{where}in no MPI call (last: {last})", 0.0

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        for watched in self._wrapped:
            watched.release()
        self._wrapped = []


class WatchedComm:
    """An mpi4py communicator whose collectives are fingerprinted and recorded; everything else passes through."""

    def __init__(self, comm, name: str, diag: Diagnostics):
        self._comm, self._name, self._diag = comm, name, diag
        self._seq = 0
        self._fp = comm.Dup() if diag.fingerprints else None

    @property
    def comm(self):
        """The plain communicator."""
        return self._comm

    def __getattr__(self, attr):
        if attr in COLLECTIVES:
            return lambda *args, **kwargs: self._collective(attr, args, kwargs)
        return getattr(self._comm, attr)

    def __eq__(self, other):
        return self._comm == (other._comm if isinstance(other, WatchedComm) else other)

    def __ne__(self, other):
        return not self == other

    __hash__ = None

    def release(self) -> None:
        """Free the fingerprints' duplicate (the communicator itself stays)."""
        if self._fp is not None:
            self._fp.Free()
            self._fp = None

    def Free(self):
        self.release()
        self._comm.Free()

    def _collective(self, op, args, kwargs):
        self._seq += 1
        site = call_site(3)
        what = f"{op} #{self._seq} over {self._name} at {site}"
        if self._fp is not None:
            self._check(op, args, kwargs, site)
        self._diag.begin(what)
        try:
            return getattr(self._comm, op)(*args, **kwargs)
        finally:
            self._diag.end()

    def _check(self, op, args, kwargs, site) -> None:
        """Allgather this call's record over the duplicate; raise on the lowest rank when the ranks differ."""
        where = COLLECTIVES[op]
        buf = args[where] if where is not None and len(args) > where else None
        if where is not None and (buf is None or buf is self._diag.MPI.IN_PLACE) and len(args) > where + 1:
            buf = args[where + 1]
        if buf is self._diag.MPI.IN_PLACE:
            buf = args[0]
        root = kwargs.get("root", "")
        key = f"{op} #{self._seq} {describe_buffer(buf) if where is not None else ''} root={root}"
        mine = pack_record(f"{key}|{site}")
        everyone = np.empty((self._fp.Get_size(), RECORD), dtype=np.uint8)
        self._fp.Allgather(mine, everyone)
        records = [unpack_record(r).split("|", 1) for r in everyone]
        if all(r[0] == key for r in records):
            return
        if self._fp.Get_rank() == 0:
            ranks = " / ".join(f"rank {i}: {r[0].removesuffix(' root=')} at {r[1]}" for i, r in enumerate(records))
            end_job(f"debug_collectives: the ranks of {self._name} called different collectives: {ranks}")
        time.sleep(10.0)  # the lowest rank of the communicator reports and aborts the job
        end_job(None)


class _Monitor:
    """The watchdog thread: heartbeats to world rank 0, which decides when the job is stuck."""

    TAG = 7

    def __init__(self, diag: Diagnostics, comm):
        self.diag, self.comm = diag, comm
        self.period = max(0.05, min(1.0, diag.timeout / 5))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpctrain-collective-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (rank 0 cancels its receives; a heartbeat sent is 240 bytes, complete when sent)."""
        self._stop.set()
        self._thread.join()
        self.comm.Free()

    def _run(self) -> None:
        MPI = self.diag.MPI
        try:
            if self.diag.rank == 0:
                self._watch(MPI)
            else:
                self._beat(MPI)
        except Exception as e:  # never take the job down silently from here
            print(f"hpctrain: warning [rank {self.diag.rank}]: the collective watchdog stopped: {e}",
                  file=sys.stderr, flush=True)

    def _beat(self, MPI) -> None:
        """Send this rank's state to rank 0 every period; abort alone if stuck for twice the timeout."""
        pending = None
        started = time.monotonic()
        while not self._stop.wait(self.period):
            text, stuck = self.diag.state()
            if pending is None or pending[0].Test():
                buf = pack_record(f"{stuck:.3f}|{text}")
                pending = (self.comm.Isend(buf, dest=0, tag=self.TAG), buf)
            if stuck > 2 * self.diag.timeout and time.monotonic() - started > 2 * self.diag.timeout:
                end_job(f"collective_timeout = {self.diag.timeout:g} s: this rank has been {text}, and rank 0 "
                            "did not end the job: it may be stopped or frozen itself")
        if pending is not None:
            pending[0].Wait()

    def _watch(self, MPI) -> None:
        """Rank 0: collect every rank's heartbeats; abort with a report when one is stuck or silent."""
        n = self.diag.size
        bufs = [np.zeros(RECORD, dtype=np.uint8) for _ in range(n)]
        reqs = [self.comm.Irecv(bufs[r], source=r, tag=self.TAG) if r else None for r in range(n)]
        seen = [time.monotonic()] * n
        texts, stuck = ["no heartbeat yet"] * n, [0.0] * n
        try:
            while not self._stop.wait(self.period):
                now = time.monotonic()
                for r in range(1, n):
                    while reqs[r].Test():
                        seconds, texts[r] = unpack_record(bufs[r]).split("|", 1)
                        stuck[r], seen[r] = float(seconds), now
                        reqs[r] = self.comm.Irecv(bufs[r], source=r, tag=self.TAG)
                texts[0], stuck[0] = self.diag.state()
                silent = [r for r in range(1, n) if now - seen[r] > self.diag.timeout]
                late = [r for r in range(n) if stuck[r] > self.diag.timeout and r not in silent]
                if silent or late:
                    # a rank that missed two heartbeats is stopped or frozen too, though it went quiet less than
                    # the timeout ago: it stopped just after another rank entered the collective that times out
                    silent = [r for r in range(1, n) if r in silent or now - seen[r] > 2.5 * self.period]
                    late = [r for r in late if r not in silent]
                    rest = [r for r in range(n) if r not in silent and r not in late]
                    # a rank in no MPI call while others wait in one holds the job up from outside MPI (its
                    # Python, a read, a lock): named right after the silent ones, as the likely cause
                    outside = [r for r in rest if late and stuck[r] == 0.0]
                    rest = [r for r in rest if r not in outside]
                    parts = ([f"rank {r} sent nothing for {now - seen[r]:.1f} s (stopped or frozen); last heard: "
                              f"{texts[r]}" for r in silent]
                             + [f"rank {r} is outside MPI while the others wait for it: {texts[r]}" for r in outside]
                             + [f"rank {r}: {texts[r]}" for r in late + rest])
                    end_job(f"collective_timeout = {self.diag.timeout:g} s: the job is stuck: " + "; ".join(parts))
        finally:
            for r in range(1, n):
                if reqs[r] is not None:
                    reqs[r].Cancel()
                    reqs[r].Wait()



def end_job(message: str | None) -> None:
    """Print ``message`` (if any) as this rank's one error line, then abort every rank (exit status 1)."""
    from mpi4py import MPI

    from .abort import abort_world

    if message:
        size = MPI.COMM_WORLD.Get_size()
        where = f" [rank {MPI.COMM_WORLD.Get_rank()}/{size}]" if size > 1 else ""
        sys.stderr.write(f"hpctrain: error{where}: {message}\n")  # one write: lines of two ranks never glue
        sys.stderr.flush()
    abort_world(1)
    os._exit(1)  # one rank alone: nothing to abort
