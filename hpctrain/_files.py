"""Checks on the files a user hands hpctrain: what may be opened, how much is read, what an HDF5 file may reference.

A path is stat'ed before it is opened, and only a regular file is opened (a FIFO or a device
would block or never end); text is read with a cap. An HDF5 dataset must keep its data in its
own file, written: external raw storage, virtual datasets and external links would make a job
read other local files, and storage never written reads as fill values. docs/reliability.md
("Hostile files and paths") lists the rules and the caps.
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import secrets
import stat

import h5py

MAX_CONFIG_BYTES = 16 << 20  # a config file larger than this is not a config
DECLARED_CAP = 1 << 30  # a dataset may always declare this many bytes ...
DECLARED_RATIO = 1024  # ... or this many times its file's size (deflate compresses at most ~1032:1)
H5_ERRORS = (OSError, KeyError, RuntimeError, ValueError, TypeError)  # what h5py raises on odd or damaged content

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def shown(text) -> str:
    """``text`` (a str or a name HDF5 returned as bytes) on one line: control and undecodable characters escaped."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "backslashreplace")
    text = str(text)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def regular_file(path: str, label: str, error, *, follow: bool = True) -> os.stat_result:
    """``os.stat(path)`` when it is a regular file, else ``error`` saying what it is; never opens it.

    ``label`` starts each message ("config file 'c.toml'", "data file d.h5"). ``follow=False``: ``path``
    itself must be the file, not a symbolic link to one (a checkpoint's shards).
    """
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        raise error(f"{label} does not exist") from None
    except OSError as e:
        raise error(f"{label} cannot be read: {shown(e.strerror or e)}") from None
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{label} is a symbolic link; hpctrain reads it only as a regular file of its own")
    _check_mode(st, label, error)
    return st


def _check_mode(st: os.stat_result, label: str, error, verb: str = "reads") -> None:
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{label} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise error(f"{label} is {kind}, not a regular file; hpctrain {verb} only regular files")


def read_capped(path: str, label: str, error, cap: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``cap`` of them (more is ``error``)."""
    if regular_file(path, label, error).st_size > cap:
        raise error(f"{label} is larger than {cap >> 20} MiB, more than hpctrain reads from it")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{label} cannot be read: {shown(e.strerror or e)}") from None
    with os.fdopen(fd, "rb") as f:
        _check_mode(os.fstat(fd), label, error)  # replaced since the stat
        try:
            data = f.read(cap + 1)
        except OSError as e:
            raise error(f"{label} cannot be read: {shown(e.strerror or e)}") from None
    if len(data) > cap:
        raise error(f"{label} is larger than {cap >> 20} MiB, more than hpctrain reads from it")
    return data


def check_replaceable(path: str, label: str, error, verb: str = "replaces") -> bool:
    """True when ``path`` is a regular file hpctrain may replace, False when nothing is there; ``error`` when
    something else is (a device, FIFO, socket, folder or symbolic link): never replaced, ``--force`` or not. Run
    as root, renaming a file over ``/dev/null`` destroys the device for the whole machine."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a folder that is a file: the writer says so)
        return False
    except OSError as e:
        raise error(f"{label}: {shown(e.strerror or e)}") from None
    if stat.S_ISREG(st.st_mode):
        return True
    if stat.S_ISLNK(st.st_mode):
        kind = "a symbolic link"
    elif stat.S_ISDIR(st.st_mode):
        kind = "a directory"
    else:
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    who = "it" if path in label else shown(path)
    raise error(f"{label}: {who} is {kind}, not a regular file; hpctrain {verb} only regular files"
                + (" (--force or not)" if verb == "replaces" else ""))


def replace_file(tmp: str, path: str, label: str, error) -> None:
    """Rename the written temporary ``tmp`` over ``path``, once ``path`` is checked to be nothing or a regular
    file (``check_replaceable``): the one way every writer puts its output under its name."""
    check_replaceable(path, label, error)
    os.replace(tmp, path)


@contextlib.contextmanager
def replaced_atomically(path: str, label: str, error):
    """Yield a temporary name beside ``path`` to write; then rename it over ``path``, so a half-written file
    never stands under its name. The temporary is created here, exclusively and never through a symbolic link,
    under a name nobody can guess (a link planted at a predictable ``<path>.tmp`` would have the write land on
    its target). Anything at ``path`` that is not a regular file is refused before and again at the rename
    (``check_replaceable``). An OSError on the way is ``error("{label}: reason")``; the temporary goes."""
    check_replaceable(path, label, error)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0666 less the umask, as any new file
        os.close(fd)
        yield tmp
        if stat.S_IMODE(os.lstat(tmp).st_mode) != mode:  # a writer that made its own file (safetensors: 0600)
            os.chmod(tmp, mode)
        replace_file(tmp, path, label, error)
    except OSError as e:
        raise error(f"{label}: {failure(e)}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def failure(e: OSError) -> str:
    """An OSError as a short phrase naming its errno: ``No space left on device (ENOSPC)``."""
    name = errno.errorcode.get(e.errno or 0, "")
    text = " ".join(shown(e.strerror or e).split())
    return f"{text} ({name})" if name and name not in text else text


class _KeepsFirstError(io.RawIOBase):
    """The file HDF5 writes a new file through (h5py's file-object driver): positioned reads and writes on a
    descriptor, where the first failing write (a full disk: ENOSPC; a file-size limit: EFBIG) is kept in
    ``error`` and every write after it dropped, so HDF5 itself never sees a failure. An HDF5 write that fails
    leaves the library's objects half-closed: h5py printed a traceback for each as it was freed, and the
    process ended with a segmentation fault. The writer checks ``error`` once HDF5 has closed the file."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd, self.pos, self.end, self.error = fd, 0, 0, None

    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.end + offset
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        view = memoryview(b).cast("B")
        data = os.pread(self.fd, len(view), self.pos) if self.error is None else b""
        n = len(data)
        view[:n] = data
        view[n:] = bytes(len(view) - n)  # what a dropped write would have put there is gone: zeros
        self.pos += len(view)
        return len(view)

    def write(self, b):
        view = memoryview(b).cast("B")
        if self.error is None:
            done = 0
            try:
                while done < len(view):
                    done += os.pwrite(self.fd, view[done:], self.pos + done)
            except OSError as e:
                self.error = e
        self.pos += len(view)
        self.end = max(self.end, self.pos)
        return len(view)

    def truncate(self, size=None):
        size = self.pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as e:
                self.error = e
        self.end = size
        return size

    def flush(self):
        pass


@contextlib.contextmanager
def h5_output(path: str, label: str, error, **kwargs):
    """A new HDF5 file at ``path`` (created exclusively unless it is the empty temporary ``replaced_atomically``
    made), opened to write with h5py; ``kwargs`` go to ``h5py.File`` (``libver``). A failing write (a full disk)
    is one ``error`` line naming ``label`` and the errno, raised once HDF5 has closed the file; the caller
    removes the file (a temporary). fsynced before it is closed."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags) if os.path.lexists(path) and os.path.getsize(path) == 0 else \
            os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise error(f"{label}: {failure(e)}") from None
    raw = _KeepsFirstError(fd)
    try:
        with h5py.File(raw, "w", **kwargs) as f:
            yield f
        if raw.error is None:
            try:
                os.fsync(fd)
            except OSError as e:
                raw.error = e
    finally:
        os.close(fd)
    if raw.error is not None:
        raise error(f"{label}: {failure(raw.error)}")


def write_bytes(path: str, data) -> None:
    """Write ``data`` (bytes or a buffer) to the existing empty file ``path`` and fsync it; an OSError on failure
    (for ``replaced_atomically`` to turn into one line)."""
    view = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def open_for_writing(path: str, label: str, error, *, append: bool = False, update: bool = False):
    """``path`` opened to write text (created 0666 less the umask; truncated unless ``append`` or ``update``:
    opened to read and rewrite as it is), never through a symbolic link and only as a regular file: one ``error``
    line otherwise."""
    check_replaceable(path, label, error, "writes")  # a device or FIFO is never opened, not even to be refused
    flags = ((os.O_RDWR if update else os.O_WRONLY) | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
             | (os.O_APPEND if append else 0))
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{label}: {path} is a symbolic link; hpctrain writes only regular files it can name") from None
        raise error(f"{label}: cannot write {path}: {shown(e.strerror or e)}") from None
    try:
        _check_mode(os.fstat(fd), f"{label}: {path}", error, "writes")
        os.set_blocking(fd, True)
        if not append and not update:
            os.ftruncate(fd, 0)
        return os.fdopen(fd, "r+" if update else ("a" if append else "w"), encoding="utf-8", newline="" if update else None)
    except BaseException:
        os.close(fd)
        raise


def member(group, name, *, allow_external: bool = False):
    """``(object, "")`` for the link ``name`` in ``group``; ``(None, "")`` when there is no such link;
    ``(None, problem)`` when it cannot be followed: a dangling or looping soft link, an external link
    (another file; followed only with ``allow_external``), a name that is not UTF-8, damaged metadata."""
    if isinstance(name, bytes):
        return None, "has a name that is not UTF-8"
    try:
        link = group.get(name, getlink=True)
    except H5_ERRORS as e:
        return None, f"cannot be opened ({shown(e)})"
    if link is None:
        return None, ""
    if isinstance(link, h5py.ExternalLink) and not allow_external:
        return None, (f"is an external link to {shown(link.path)} in {shown(link.filename)}: "
                      "a file may not reference other files")
    try:
        return group[name], ""
    except H5_ERRORS as e:
        if isinstance(link, h5py.SoftLink):
            return None, f"is a soft link to {shown(link.path)} that leads nowhere (dangling, or a loop of links)"
        return None, f"cannot be opened, the file is damaged ({shown(e)})"


def storage_problem(ds: h5py.Dataset, file_size: int, *, allow_external: bool = False) -> str:
    """'' when ``ds`` keeps written data in its own file, of a size the file can hold; else the problem.

    Refused: an empty dataspace, virtual datasets and external raw storage (unless ``allow_external``;
    then the other checks are skipped), storage never allocated (HDF5 would return fill values), and a
    declared size above both DECLARED_CAP and DECLARED_RATIO times ``file_size``.
    """
    shape = ds.shape
    if shape is None:
        return "holds no data (an empty dataspace)"
    if ds.is_virtual:
        return "" if allow_external else "is a virtual dataset (it maps data from other files), which hpctrain refuses"
    plist = ds.id.get_create_plist()
    if plist.get_external_count():
        if allow_external:
            return ""
        name = shown(plist.get_external(0)[0])
        return f"keeps its data in another file ({name}: HDF5 external storage), which hpctrain refuses"
    declared = math.prod(shape) * ds.dtype.itemsize
    if declared and ds.id.get_storage_size() == 0:
        return f"is declared (shape {shape}) but never written: HDF5 would return fill values"
    if declared > max(DECLARED_CAP, DECLARED_RATIO * file_size):
        return (f"declares shape {shape} of {ds.dtype} ({declared:,} bytes), more than {DECLARED_RATIO} times "
                f"the file's {file_size:,} bytes can hold; the file is damaged or forged")
    return ""
