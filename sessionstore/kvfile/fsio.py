"""The file-system primitives, one home each (FORMAT.md 3: durability; the house style's "one
helper per primitive"): every room opens, writes, replaces and fsyncs through these.

- :func:`open_regular`: open without following a symlink and refuse anything but a regular file
  (a symlink's ``ELOOP`` and a FIFO, device or directory become our :class:`FormatError`).
- :func:`pwrite_all`: write all of a buffer at an offset (loops over short writes).
- :func:`atomic_replace`: a whole file replaced: temp -> fsync -> rename -> fsync the directory.
- :func:`fsync_directory` (this directory) and :func:`fsync_parent` (the directory holding this
  path): the two meanings of "fsync the directory", under two names.
The one bounded JSON read (a small JSON file read without ever holding more than its limit) is
:func:`kernels.jsonfile.read_json_bounded`: kernels holds it so the decoder's loaders share it.

The append path's fault seam (:class:`sessionstore.kvfile.durability.Durability`) uses these for
its real I/O; code that must stay injectable passes its ``Durability.open`` as ``opener``.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable

from kernels.errors import FormatError

Buffer = bytes | bytearray | memoryview
Opener = Callable[[str, int, int], int]  # os.open's (path, flags, mode) -> fd

_KIND_NAMES = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symlink"}
_SWAPPED_ERRNOS = (errno.EISDIR, errno.ENXIO, errno.ENODEV)  # a directory, FIFO or device put there


def describe_mode(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO", "a symlink", ...)."""
    return _KIND_NAMES.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: str | os.PathLike[str], flags: int, mode: int = 0o644, *, what: str = "",
                 same_as: os.stat_result | None = None, opener: Opener = os.open) -> int:
    """Open ``path`` with ``flags | O_NOFOLLOW | O_CLOEXEC`` and return the descriptor of a
    regular file; anything else is closed and refused with :class:`FormatError`.

    ``what`` names the file in the messages (``<path>: <what> is a symlink; refusing it``,
    ``<path>: <what> is not a regular file``). ``same_as`` is the ``lstat`` the caller looked at
    before opening: then the descriptor must be that same file, and a swap in between (a symlink,
    a directory, a FIFO or a device, or another inode) is refused as "changed while opening".
    Other OSErrors (FileNotFoundError included) are raised as they are, for the caller to word.
    ``opener`` is ``os.open`` or a fault seam's ``open`` with the same signature.
    """
    where = os.fspath(path)
    label = f"{what} " if what else ""
    try:
        fd = opener(where, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            if same_as is not None:
                raise FormatError(f"{where}: became a symlink while opening; refusing it") from None
            raise FormatError(f"{where}: {label}is a symlink; refusing it") from None
        if same_as is not None and exc.errno in _SWAPPED_ERRNOS:
            raise FormatError(f"{where}: changed while opening: {exc.strerror}") from None
        raise
    try:
        st = os.fstat(fd)
        if same_as is not None:
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (same_as.st_dev, same_as.st_ino):
                raise FormatError(f"{where}: changed while opening (now {describe_mode(st.st_mode)}); refusing it")
        elif not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{where}: {label}is not a regular file" if what else f"{where}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def pwrite_all(fd: int, data: Buffer, offset: int, where: str = "") -> None:
    """Write all of ``data`` at ``offset``, looping over short writes; a write of 0 bytes raises
    ``OSError(EIO)`` (naming ``where`` when given) instead of looping forever."""
    view = memoryview(data).cast("B")
    while len(view):
        done = os.pwrite(fd, view, offset)
        if done <= 0:
            prefix = f"{where}: " if where else ""
            raise OSError(errno.EIO, f"{prefix}pwrite wrote {done} bytes at offset {offset}")
        view = view[done:]
        offset += done


def write_all(fd: int, data: Buffer) -> int:
    """Write all of ``data`` at the descriptor's position (loops over short writes); its length."""
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        view = view[os.write(fd, view):]
    return total


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """fsync ``directory`` itself (makes the names created, renamed or removed in it durable)."""
    fd = os.open(os.fspath(directory), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_parent(path: str | os.PathLike[str]) -> None:
    """fsync the directory that holds ``path`` (makes a new name or a rename of ``path`` durable)."""
    fsync_directory(os.path.dirname(os.path.abspath(path)) or ".")


def atomic_replace(path: str | os.PathLike[str], data: Buffer, *,
                   make_temp: Callable[[str], tuple[int, str]], durable: bool = True) -> None:
    """Replace ``path`` with ``data`` whole: ``make_temp(path)`` gives a new temp file (fd, name)
    beside it; the data is written, fsynced (``durable``), renamed over ``path`` and the directory
    fsynced (``durable``). On any error before the rename the temp file is removed and the error
    raised; ``path`` is then untouched. An OSError without a file name is given ``path``'s."""
    where = os.fspath(path)
    fd, tmp = make_temp(where)
    try:
        write_all(fd, data)
        if durable:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, where)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = where  # ENOSPC/EIO name the file, not a nameless write
        raise
    if durable:
        fsync_parent(where)


def unlink_durably(path: str | os.PathLike[str]) -> bool:
    """Remove ``path`` and fsync its directory (the removal survives a crash); True if it was there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_parent(path)
    return True


def readable_temp(prefix: str) -> Callable[[str], tuple[int, str]]:
    """A ``make_temp`` for :func:`atomic_replace`: a new ``<prefix>*.tmp`` beside the path, mode
    0644 (mkstemp makes 0600; a session's metadata is as readable as its kv file)."""

    def make(path: str) -> tuple[int, str]:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=os.path.dirname(path))
        try:
            os.fchmod(fd, 0o644)
        except BaseException as exc:
            os.close(fd)
            os.unlink(tmp)
            if isinstance(exc, OSError) and exc.filename is None:
                exc.filename = path
            raise
        return fd, tmp

    return make


__all__ = [
    "Buffer", "Opener", "atomic_replace", "describe_mode", "fsync_directory", "fsync_parent", "open_regular",
    "pwrite_all", "readable_temp", "unlink_durably", "write_all"
]
