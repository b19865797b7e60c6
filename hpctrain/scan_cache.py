"""What the start-up data scan already proved: a small JSON record per data file, so a second start skips it.

The scan (data.py: ``Dataset.scan``, ``TokenDataset.scan``) reads every value of the data file at every
start: gigabytes on a shared file system before the first step. After a scan that every rank found clean,
world rank 0 records the file's identity and what was checked; a later start whose record matches skips
the scan. The identity is the file's size, inode, modification and change times and a SHA-256 of 16 blocks
of 64 KiB spread over it (the first and last included), so a file rewritten, truncated or replaced is scanned
again, also when a copy kept the modification time (``cp -p``, ``rsync -a``, ``os.utime``: the change time
cannot be set, and every write moves it);
``checks`` names the rules (the scan's version, the datasets, the loss or the vocabulary, the widths), so a
config that checks something else is scanned again too.

    key = scan_key(path, checks)        # None: the file cannot be read here (the scan will say why)
    if key and is_clean(key): ...       # skip the scan
    remember_clean(key)                 # after every rank's share came back clean

Records live in ``$HPCTRAIN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/hpctrain`` or ``~/.cache/hpctrain``),
one file per data path; ``HPCTRAIN_CACHE_DIR=off`` turns the cache off. A record that cannot be read,
parsed or written is as if absent: the scan runs. JSON only.
"""

from __future__ import annotations

import hashlib
import json
import os

from ._files import replaced_atomically

__all__ = ["scan_key", "is_clean", "remember_clean", "cache_dir", "SCAN_VERSION"]

SCAN_VERSION = 2  # raise when the scan's rules change: every record is then stale
BLOCKS, BLOCK = 16, 64 << 10


def cache_dir() -> str | None:
    """The records' folder, or None when the cache is off."""
    where = os.environ.get("HPCTRAIN_CACHE_DIR")
    if where is not None:
        return None if where.strip().lower() in ("", "off", "0", "none") else where
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hpctrain")


def scan_key(path: str, checks: str) -> dict | None:
    """The identity of the data file at ``path`` and the rules ``checks``, or None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        digest = hashlib.sha256()
        n = max(1, BLOCKS)
        for i in range(n):
            at = 0 if n == 1 else (st.st_size - BLOCK) * i // (n - 1)
            digest.update(os.pread(fd, BLOCK, max(0, at)))
    except OSError:
        return None
    finally:
        os.close(fd)
    return {"version": SCAN_VERSION, "path": os.path.abspath(path), "size": st.st_size, "inode": st.st_ino,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "sample_sha256": digest.hexdigest(),
            "checks": checks}


def _record(key: dict) -> str | None:
    folder = cache_dir()
    if folder is None:
        return None
    name = hashlib.sha256(key["path"].encode("utf-8", "backslashreplace")).hexdigest()[:24]
    return os.path.join(folder, f"scan-{name}.json")


def is_clean(key: dict | None) -> bool:
    """Whether a record says the file, as ``key`` finds it now, passed these checks before."""
    record = _record(key) if key else None
    if record is None:
        return False
    try:
        with open(record, encoding="utf-8") as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return False
    return stored == {**key, "clean": True}


def remember_clean(key: dict | None) -> bool:
    """Record that every rank's share of the file passed the checks; False when it could not be written."""
    record = _record(key) if key else None
    if record is None:
        return False
    try:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        with replaced_atomically(record, "scan cache", OSError) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump({**key, "clean": True}, f)
    except OSError:
        return False
    return True
