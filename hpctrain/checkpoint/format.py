"""On-disk details of hpctrain checkpoints: file names, atomic writes, digests, attributes.

docs/checkpoint-format.md is the reference for everything here; hpctrain/checkpoint/__init__.py
builds the public API on top. Nothing in this module talks to MPI: only the rank
that writes (rank 0) calls it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

from .._files import member, regular_file, shown, storage_problem
from ..config import INT64_MAX
from ..errors import CheckpointError

FORMAT = "hpctrain-checkpoint"
VERSION = 3  # the newest this hpctrain reads; bump only when an older reader would misread a newer file
SINGLE_FILE_VERSION = 2  # one file holding every tensor (2: fixed-length strings); 3 is a sharded set
DIGEST = "sha256"  # root attribute ``checksum`` and the per-dataset attribute name
LIBVER = ("v108", "v108")  # superblock v2 and v2 object headers: HDF5 checksums the metadata too
OPTIMIZERS = {  # optimizer name -> (slots it must have, slots it may have), torch.optim's names
    "sgd": ((), ("momentum_buffer",)),
    "adam": (("exp_avg", "exp_avg_sq"), ()),
    "adamw": (("exp_avg", "exp_avg_sq"), ()),
}
LAYOUT_KEYS = ("world_size", "dp", "pp", "tp")
ATTRS_DIGEST = "attrs_sha256"  # root attribute: sha256 of the other root attributes
RNG_PREFIX = "rng_"
MAX_STEP = 2**62  # step counters read from a file: far beyond any run, with room to count on in int64

_NAME_RE = re.compile(r"^ckpt-(\d{8,})\.h5$")
_TEMP_RE = re.compile(r"^\.ckpt-\d{8,}\.h5\.(?P<host>.+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
STALE_SECONDS = 15 * 60  # a temp file from another host untouched this long has no live writer


# --------------------------------------------------------------------------- names and files


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.h5"


def names_in(directory: str) -> list[str]:
    """The names in ``directory``; none where it does not exist (yet: nothing saved there)."""
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``ckpt-<step>.h5`` in ``directory``, oldest step first; temp files never match."""
    found = []
    for name in names_in(directory):
        m = _NAME_RE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def temp_path(directory: str, step: int) -> str:
    """A fresh hidden name next to the final one, which no loader mistakes for a checkpoint.

    The caller creates it exclusively (h5py mode "x"), so it gets the permissions of any new
    file (0666 less the umask), not mkstemp's 0600, and the renamed checkpoint keeps them.
    """
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    return os.path.join(directory, f".{checkpoint_name(step)}.{host}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def clean_stale_temps(directory: str) -> list[str]:
    """Remove temp files whose writer is gone: this host's with a dead pid, and any untouched for STALE_SECONDS."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    removed = []
    for name in os.listdir(directory):
        m = _TEMP_RE.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            dead = m.group("host") == host and not _pid_alive(int(m.group("pid")))
            if dead or time.time() - os.stat(path).st_mtime > STALE_SECONDS:
                os.unlink(path)
                removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make a rename or unlink in ``directory`` durable; file systems that cannot fsync a directory say EINVAL."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def open_read(path: str, what: str) -> h5py.File:
    """Open read-only (no HDF5 file lock: files are immutable once renamed into place, and Lustre/NFS often lack flock)."""
    regular_file(path, f"{what} {path}", CheckpointError)  # never open a FIFO or a device: it would block
    try:
        with open(path, "rb"):  # h5py.is_hdf5 says False for an unreadable file; say why instead
            pass
        is_hdf5 = h5py.is_hdf5(path)
    except OSError as e:
        raise CheckpointError(f"{what} {path} cannot be read ({shown(e)})") from None
    if not is_hdf5:
        raise CheckpointError(f"{what} {path} is not an HDF5 file")
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as e:
        hint = " (the file is truncated)" if "truncated" in str(e) else " (damaged or truncated?)"
        raise CheckpointError(f"{what} {path} cannot be opened as HDF5{hint}: {shown(e)}") from None


# --------------------------------------------------------------------------- datasets and digests


def sha256_hex(arr: np.ndarray) -> str:
    """Digest of the array's bytes: C order, little-endian float32, exactly what the dataset stores."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))).hexdigest()


def workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def write_dataset(f: h5py.File, path: str, arr: np.ndarray) -> None:
    """One contiguous (unchunked, unfiltered) little-endian float32 dataset; a plain reader can mmap it."""
    f.create_dataset(path, data=arr)


def write_datasets(f: h5py.File, arrays: list[tuple[str, np.ndarray]]) -> None:
    """Write every ``(path, array)`` and its ``sha256`` attribute; digests are computed in threads meanwhile."""
    with ThreadPoolExecutor(workers()) as pool:
        digests = [(path, pool.submit(sha256_hex, arr)) for path, arr in arrays]
        for path, arr in arrays:
            write_dataset(f, path, arr)
            start_writeback(f, f[path])
        for path, digest in digests:
            set_attr(f[path].attrs, DIGEST, digest.result())


def start_writeback(f: h5py.File, ds: h5py.Dataset) -> None:
    """Ask the kernel to start writing a dataset's pages now, so the disk works while the CPU hashes and copies.

    POSIX_FADV_DONTNEED starts writeback of dirty pages on Linux (and drops clean ones); it is
    only a hint, so where it is missing or refused the final fsync simply does all the work.
    """
    if not hasattr(os, "posix_fadvise") or ds.size < (1 << 20):
        return
    try:
        os.posix_fadvise(f.id.get_vfd_handle(), ds.id.get_offset(), ds.id.get_storage_size(), os.POSIX_FADV_DONTNEED)
    except (OSError, ValueError, TypeError):
        pass


def checksum_kind(ds: h5py.Dataset) -> str:
    if DIGEST in ds.attrs:
        return DIGEST
    return "fletcher32" if ds.fletcher32 else "none"


def verify_datasets(items, *, keep: bool):
    """Read ``(label, dataset)`` items and check each one's checksum; yield ``(label, array or None, problem)``.

    ``problem`` is "" when the stored sha256 matches (or HDF5's Fletcher32 filter passed
    on read), else what went wrong. Digests run in threads while the next dataset is
    read; at most a few arrays are held at once unless ``keep``.
    """
    pending = []
    with ThreadPoolExecutor(workers()) as pool:
        for label, ds in items:
            try:
                arr = np.empty(ds.shape, dtype="<f4")
                if arr.size:
                    ds.read_direct(arr)
            except (OSError, ValueError, TypeError, RuntimeError) as e:
                kind = "fletcher32 checksum failed or data unreadable" if ds.fletcher32 else "data unreadable"
                pending.append((label, None, None, f"{kind} ({e})"))
                continue
            stored = ds.attrs.get(DIGEST)
            if isinstance(stored, bytes):
                stored = stored.decode("ascii", "replace")
            pending.append((label, arr, stored, pool.submit(sha256_hex, arr) if stored is not None else None))
            while len(pending) > 2 * workers():
                yield _settle(pending.pop(0), keep)
        while pending:
            yield _settle(pending.pop(0), keep)


def _settle(item, keep):
    label, arr, stored, digest = item
    if arr is None:
        return label, None, digest  # here ``digest`` is the read problem
    problem = ""
    if digest is not None:
        actual = digest.result()
        if not isinstance(stored, str) or actual != stored:
            problem = f"sha256 mismatch (stored {str(stored)[:16]}..., data hashes to {actual[:16]}...)"
    return label, (arr if keep else None), problem


def fit_problems(group, layout, *, strict_dtype: bool = True) -> list[str]:
    """What keeps ``group`` (``/params`` or an optimizer slot) from fitting ``layout``; [] when it fits.

    ``strict_dtype``: the datasets must be little-endian float32 (checkpoints), else any float (weights files).
    Members that cannot be followed or hold no data are left to ``member_problems``.
    """
    have = set(group.keys())
    want = set(layout.names)
    problems = []
    if want - have:
        problems.append("missing " + ", ".join(_by_layout(want - have, layout)))
    if have - want:
        problems.append("unexpected " + ", ".join(sorted(shown(n) for n in have - want)))
    for spec in layout:
        if spec.name not in have:
            continue
        obj, _ = member(group, spec.name)
        if obj is None:
            continue
        if not isinstance(obj, h5py.Dataset):
            problems.append(f"{spec.name} is a group, not a dataset")
        elif obj.shape is None:
            continue
        elif tuple(obj.shape) != spec.shape:
            problems.append(f"{spec.name} has shape {tuple(obj.shape)}, the model needs {spec.shape}")
        elif strict_dtype and obj.dtype != np.dtype("<f4"):
            problems.append(f"{spec.name} has dtype {obj.dtype}, expected little-endian float32")
        elif obj.dtype.kind != "f":
            problems.append(f"{spec.name} has dtype {obj.dtype}, expected a float type")
    return problems


def member_problems(group, file_size: int, *, require_digest: bool) -> list[str]:
    """``"<path> <problem>"`` for each member of ``group`` that cannot be read as data of this file.

    A link must lead to an object in this file; a dataset must keep written data in this file
    (no external or virtual storage, nothing larger than the file can hold) and, when
    ``require_digest`` (a checkpoint), carry its ``sha256`` attribute.
    """
    problems = []
    for name in group.keys():
        where = f"{group.name}/{shown(name)}"
        obj, problem = member(group, name)
        if not problem and isinstance(obj, h5py.Dataset):
            problem = storage_problem(obj, file_size)
            if not problem and require_digest and DIGEST not in obj.attrs:
                problem = f"has no {DIGEST} attribute: every dataset of a checkpoint carries its digest"
        if problem:
            problems.append(f"{where} {problem}")
    return problems


def _by_layout(names, layout):
    return [n for n in layout.names if n in names]


# --------------------------------------------------------------------------- attributes


def check_rng(rng: dict) -> None:
    for key, value in rng.items():
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise ValueError(f"rng key {key!r} must be an identifier")
        if not isinstance(value, (bool, int, float, str, np.integer, np.floating, np.bool_)):
            raise TypeError(f"rng[{key!r}] must be a bool, int, float or str, got {type(value).__name__}")


def encode_attr(value):
    """Python scalar -> what h5py stores: bool as HDF5 enum (numpy bool), int as int64, float as float64, str as UTF-8."""
    if isinstance(value, (bool, np.bool_)):
        return np.bool_(value)
    if isinstance(value, (int, np.integer)):
        return np.int64(value)
    if isinstance(value, (float, np.floating)):
        return np.float64(value)
    return str(value)


def set_attr(attrs, key: str, value) -> None:
    """Store one attribute, encoded as ``encode_attr`` says; a string as fixed-length UTF-8.

    h5py would store a str as a variable-length string in the file's global heap,
    which HDF5 does not checksum: one damaged byte there made reading the
    attribute spin for ever. A fixed-length string lives in the object header,
    which the v2 headers (``LIBVER``) checksum.
    """
    value = encode_attr(value)
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogateescape")
        attrs.create(key, np.bytes_(data), dtype=h5py.string_dtype("utf-8", max(1, len(data))))
    else:
        attrs[key] = value


def decode_attr(value):
    """What h5py returns -> the Python scalar; None for anything else (arrays, compound types)."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    return None


def attrs_digest(attrs) -> str:
    """sha256 of every root attribute but ATTRS_DIGEST: compact JSON of {name: value}, keys sorted, UTF-8."""
    values = {k: decode_attr(v) for k, v in attrs.items() if k != ATTRS_DIGEST}
    text = json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()  # damaged text still hashes


def int_attr(attrs, key: str, path: str, *, minimum: int = 0) -> int:
    if key not in attrs:
        raise CheckpointError(f"checkpoint {path} has no root attribute {key!r}")
    value = decode_attr(attrs[key])
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= INT64_MAX:
        raise CheckpointError(f"checkpoint {path}: root attribute {key!r} = {shown(repr(attrs[key]))}, expected an "
                              f"integer in [{minimum}, 2**63 - 1]")
    return value


def str_attr(attrs, key: str, path: str) -> str:
    if key not in attrs:
        raise CheckpointError(f"checkpoint {path} has no root attribute {key!r}")
    value = decode_attr(attrs[key])
    if not isinstance(value, str):
        raise CheckpointError(f"checkpoint {path}: root attribute {key!r} = {shown(repr(attrs[key]))}, expected a "
                              "string")
    return value
