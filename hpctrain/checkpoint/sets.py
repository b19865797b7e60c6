"""A sharded checkpoint's names on disk, and the sets in a folder: which one hpctrain may remove, removing it,
and the folders of saves that never committed.

    ckpt-00001500.h5                          the index (checkpoint/sharded.py writes and reads it)
    ckpt-00001500.<set id>.shards/rank-00003.h5   world rank 3's shard

A checkpoint is removed (retention, a replaced step, an orphan) only when its name, ``step`` attribute, set id and
shards' folder agree, and the folder holds only shard files: a copy or a renamed file never takes another step's
shards with it. Nothing here talks to MPI.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat

import h5py
import numpy as np

from . import format as fmt
from .._files import H5_ERRORS, shown

__all__ = ["new_set_id", "set_dir_name", "shard_name", "set_dir_of", "owned_set", "owned_set_dir", "remove_set",
           "clean_orphans", "SET_RE", "SHARD_RE", "SET_ID_RE"]

SET_RE = re.compile(r"^ckpt-(\d{8,})\.([0-9a-f]{16})\.shards$")
SHARD_RE = re.compile(r"^rank-(\d{5,})\.h5$")
SET_ID_RE = re.compile(r"^[0-9a-f]{16}$")


def new_set_id() -> str:
    return secrets.token_hex(8)


def set_dir_name(step: int, set_id: str) -> str:
    return f"{fmt.checkpoint_name(step)[:-3]}.{set_id}.shards"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


def set_dir_of(index_path: str) -> str | None:
    """The shards' folder the index names (from its ``set_id`` attribute), or None for a single-file checkpoint
    or an index that cannot be read."""
    try:
        with h5py.File(index_path, "r", locking=False) as f:
            set_id = fmt.decode_attr(f.attrs.get("set_id"))
            step = fmt.decode_attr(f.attrs.get("step"))
    except (OSError, *H5_ERRORS):
        return None
    if not isinstance(set_id, str) or not SET_ID_RE.match(set_id) or not isinstance(step, int) or step < 0:
        return None
    return os.path.join(os.path.dirname(index_path), set_dir_name(step, set_id))


def owned_set(index_path: str) -> tuple[str | None, str]:
    """``(shards' folder or None, "")`` when the checkpoint at ``index_path`` is one hpctrain may remove: its
    name is ``ckpt-<step>.h5``, its ``step`` attribute that step and, for a sharded set, its ``set_id`` and its
    manifest's folder name ``ckpt-<step>.<set id>.shards`` beside it, a real folder holding only shard files
    (None: a single file, nothing else to remove). Else ``(None, why not)``: a copy of another step's index
    saved under this name would otherwise have its removal take that step's shards."""
    name = os.path.basename(index_path)
    m = re.match(r"^ckpt-(\d{8,})\.h5$", name)
    if not m:
        return None, "its name is not ckpt-<step>.h5"
    try:
        st = os.lstat(index_path)
    except OSError as e:
        return None, f"it cannot be read ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):  # never opened: a FIFO would block
        return None, "it is not a regular file"
    try:
        with h5py.File(index_path, "r", locking=False) as f:
            set_id = fmt.decode_attr(f.attrs.get("set_id"))
            step = fmt.decode_attr(f.attrs.get("step"))
            ds = f.get("manifest") if set_id is not None else None
            raw = ds[()] if isinstance(ds, h5py.Dataset) and ds.dtype == np.uint8 and ds.ndim == 1 else None
    except (OSError, *H5_ERRORS) as e:
        return None, f"it cannot be read ({' '.join(shown(e).split())})"
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step != int(m.group(1)):
        return None, (f"its step attribute is {shown(repr(step))[:40]}, not the {int(m.group(1))} of its name "
                      "(a copy or a renamed file)")
    if set_id is None:
        return None, ""  # a single-file checkpoint: the file is all there is
    if not isinstance(set_id, str) or not SET_ID_RE.match(set_id):
        return None, f"its set_id {shown(repr(set_id))[:40]} is not 16 hex digits"
    folder = set_dir_name(int(step), set_id)
    try:
        manifest_folder = json.loads(raw.tobytes().decode("utf-8"))["folder"] if raw is not None else None
    except (ValueError, KeyError, TypeError):
        manifest_folder = None
    if manifest_folder != folder:
        return None, f"its manifest does not name the shards' folder {folder} (damaged, or another set's)"
    path = os.path.join(os.path.dirname(index_path), folder)
    if os.path.islink(path):
        return None, f"its shards' folder {folder} is a symbolic link"
    if not os.path.lexists(path):
        return None, f"its shards' folder {folder} does not exist"
    if not os.path.isdir(path):
        return None, f"its shards' folder {folder} is not a folder"
    foreign = _foreign(path)
    if foreign:
        return None, f"its shards' folder {folder} holds {shown(foreign)}, which is no shard of a set"
    return path, ""


def _foreign(folder: str) -> str:
    """The first entry of a set's folder that is not a shard file hpctrain writes (``rank-<n>.h5``), or ''."""
    try:
        with os.scandir(folder) as entries:
            for e in entries:
                if not SHARD_RE.match(e.name) or not e.is_file(follow_symlinks=False):
                    return e.name
    except OSError as e:
        return f"an unreadable listing ({e.strerror or e})"
    return ""


def owned_set_dir(index_path: str) -> str | None:
    """The shards' folder of the set at ``index_path`` when ``owned_set`` finds it ours, else None."""
    return owned_set(index_path)[0] if os.path.lexists(index_path) else None


def _say(line: str) -> None:
    print(line, flush=True)


def remove_set(index_path: str, log=None) -> bool:
    """Remove a checkpoint: its index first (the set is gone at once), then its shards' folder if any; only when
    ``owned_set`` finds name, step, set id and folder in agreement. Else both stay, with one ``log`` line; False."""
    folder, problem = owned_set(index_path)
    if problem:
        (log or _say)(f"checkpoint: left {index_path} in place, not removed: {problem}; hpctrain removes only "
                      "checkpoints whose name, step, set id and shards' folder agree")
        return False
    try:
        os.unlink(index_path)
    except FileNotFoundError:
        pass
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    return True


def clean_orphans(directory: str, keep: str = "") -> list[str]:
    """Remove set folders that no file of their step names (``ckpt-<step>.h5``, or one set aside as
    ``.skipped``): saves that never committed. ``keep``: the folder of a save in progress."""
    names = fmt.names_in(directory)
    removed = []
    for name in names:
        m = SET_RE.match(name)
        if not m or name == keep:
            continue
        index = fmt.checkpoint_name(int(m.group(1)))
        if any(n == index or n.startswith(index + ".skipped") for n in names):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path) and not _foreign(path):  # only shards: ours
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
