"""One job per checkpoint folder: a lock file that world rank 0 holds from start-up to the end of the run.

    lock = FolderLock.take(cfg.checkpoint.dir, log=log)   # CheckpointInUseError if another job holds it
    ...                                                    # read, resume, train, write checkpoints
    lock.release()

The lock is ``fcntl.flock`` on ``<checkpoint.dir>/hpctrain.lock``. The file says who
holds it (host, pid, start time, ``SLURM_JOB_ID``, command line), so a second job can
name the holder in its error. The kernel drops a flock when its process dies, even
by ``kill -9``: a lock file left behind by a crash is harmless, and the next job
takes it over (a requeued Slurm job, too) and logs whose it was. ``release`` removes
the file, then drops the lock.

flock is as good as the filesystem under the folder: local disks and NFS (Linux
maps flock to NFS byte-range locks) lock across processes and nodes; Lustre does
only when mounted with ``-o flock`` (``localflock`` locks within one node only,
``noflock`` refuses). A refusal is an error, never a silent run without the lock.

Nothing here talks to MPI: only world rank 0 calls it, inside an agreement.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time

from ..errors import CheckpointError, CheckpointInUseError
from ..parallel.slurm import SRUN_MPI_HINT, same_step

__all__ = ["LOCK_NAME", "FolderLock"]

LOCK_NAME = "hpctrain.lock"
_TRIES = 20  # the file replaced under us (its holder released it while we opened it), or still being written


class FolderLock:
    """A held lock on one checkpoint folder; ``release()`` (idempotent) gives it up."""

    def __init__(self, folder: str, path: str, file, created_folder: bool):
        self.folder, self.path, self._file, self._created_folder = folder, path, file, created_folder

    @classmethod
    def take(cls, folder: str, *, log) -> "FolderLock":
        """Lock ``folder`` (created if missing) for this process, or raise naming the holder.

        CheckpointInUseError: another live process holds it. CheckpointError: the lock
        file cannot be opened, or the filesystem refuses flock.
        """
        created = False
        path = os.path.join(folder, LOCK_NAME)
        for _ in range(_TRIES):
            if not os.path.isdir(folder):
                try:
                    os.makedirs(folder, exist_ok=True)
                except OSError as e:
                    raise CheckpointError(f"checkpoint.dir {folder} cannot be created: {e.strerror or e}") from None
                created = True
            try:
                f, new_file = _open(path)
            except FileNotFoundError:  # removed by a job that just released it: make it again
                continue
            except OSError as e:
                raise CheckpointError(f"checkpoint.dir {folder}: cannot open its lock file {LOCK_NAME}: "
                                      f"{e.strerror or e}") from None
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _holder(f)
                f.close()
                who = _describe(record) if record else f"another process (its lock file {path} names none)"
                if same_step(record):
                    raise CheckpointInUseError(
                        f"checkpoint.dir {folder} is in use by {who}, a task of this same job step: the step's tasks "
                        f"are separate MPI worlds, not one job; {SRUN_MPI_HINT}") from None
                raise CheckpointInUseError(f"checkpoint.dir {folder} is in use by {who}; only one job may use "
                                           "a checkpoint folder at a time: wait for that job to end, or give this "
                                           "one another checkpoint.dir") from None
            except OSError as e:
                f.close()
                _undo(path if new_file else "", folder if created else "")
                raise CheckpointError(f"checkpoint.dir {folder}: cannot lock {path}: flock failed: {e.strerror or e} "
                                      "(the filesystem does not support flock, e.g. Lustre mounted without -o flock); "
                                      "use a checkpoint.dir on a filesystem that does, or set checkpoint.lock = false "
                                      "and make sure no other job uses this folder") from None
            if _same_file(f, path):
                break
            f.close()  # its holder removed it between our open and our flock: the lock is the new file's
        else:
            raise CheckpointError(f"checkpoint.dir {folder}: could not take the lock {LOCK_NAME} in {_TRIES} tries: "
                                  "other jobs keep replacing it")
        previous = _parse(_read(f))
        try:
            _write_holder(f)
        except OSError as e:
            f.close()
            raise CheckpointError(f"checkpoint.dir {folder}: cannot write its lock file {path}: "
                                  f"{e.strerror or e}") from None
        if previous:
            same_job = previous.get("job") and previous.get("job") == os.environ.get("SLURM_JOB_ID")
            log(f"checkpoint.dir {folder}: taking over a stale lock of {_describe(previous)}, which no longer holds "
                "it (the process ended without releasing it)" + ("; the same Slurm job, requeued" if same_job else ""))
        return cls(folder, path, f, created)

    def release(self) -> None:
        """Remove the lock file and drop the lock; remove the folder too if ``take`` made it and it is empty."""
        if self._file is None:
            return
        try:
            if _same_file(self._file, self.path):  # still ours: never remove a successor's file
                os.unlink(self.path)
        except OSError:
            pass  # the flock goes with the file descriptor below in any case
        self._file.close()
        self._file = None
        if self._created_folder:
            try:
                os.rmdir(self.folder)  # a job that failed at start-up leaves nothing behind
            except OSError:
                pass


def _open(path: str):
    """The lock file opened for reading and writing, and whether this call created it.

    Never through a symbolic link (O_EXCL creates no file at a link's target, O_NOFOLLOW opens none) and only a
    regular file: the lock is written, and a link named hpctrain.lock would have the run overwrite whatever it
    points to (as root, any file on the machine). CheckpointError otherwise."""
    try:
        fd, new = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), True
    except FileExistsError:
        try:
            fd, new = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK), False
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(f"{path} is a symbolic link; hpctrain never writes through one: remove it "
                                      "(no job is using the folder through it)") from None
            raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file (a FIFO, socket or device): remove it")
    return os.fdopen(fd, "r+", encoding="utf-8"), new


def _undo(path: str, folder: str) -> None:
    """Remove the lock file and the folder a failed ``take`` made (either may be "")."""
    for remove, name in ((os.unlink, path), (os.rmdir, folder)):
        if name:
            try:
                remove(name)
            except OSError:
                pass


def _same_file(f, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(f.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _write_holder(f) -> None:
    record = {"what": "hpctrain checkpoint.dir lock", "host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "job": os.environ.get("SLURM_JOB_ID", ""),
              "step": os.environ.get("SLURM_STEP_ID", ""), "command": " ".join(sys.argv)}
    f.seek(0)
    f.truncate()
    f.write(json.dumps(record, indent=1) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _read(f) -> str:
    f.seek(0)
    try:
        return f.read(65536)
    except (OSError, UnicodeDecodeError):
        return ""


def _parse(text: str) -> dict:
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _holder(f) -> dict:
    """The holder's record from the lock file ({} if it names none; the holder writes it just after taking the
    lock: wait a little)."""
    for _ in range(_TRIES):
        record = _parse(_read(f))
        if record:
            return record
        time.sleep(0.05)
    return {}


def _describe(record: dict) -> str:
    text = f"pid {record.get('pid', '?')} on host {record.get('host', '?')} since {record.get('started', '?')}"
    return text + (f" (job {record['job']})" if record.get("job") else "")
