"""Opening a ``.coli_kv`` file for write (FORMAT.md 3.2), before a :class:`KVWriter` exists.

Under the writer lock: stale temps of a crashed create or upgrade are removed, a missing file is
created whole (temp, fsync, rename, fsync the directory), and the file is opened without
following a symlink and checked to be the same regular file that was looked at, with a header
that parses and whose dims and version fit the caller's model and kv dtype.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from kernels.errors import FormatError, ModelMismatchError, NotFoundError
from kernels.rows import KV_FORMAT_OF_DTYPE
from sessionstore.kvfile import upgrade as _upgrade
from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.fsio import describe_mode, open_regular
from sessionstore.kvfile.header import HEADER_SIZE, Dims, Header, pack_header, parse_header
from sessionstore.log import get_logger

CREATE_SUFFIX = ".create.tmp"

log = get_logger("writer")


@dataclass(frozen=True)
class OpenedFile:
    """A checked read-write descriptor on the file and what it holds."""

    fd: int
    header: Header
    size: int
    created: bool


def refuse_non_regular(path: str) -> None:
    """Before the lock: no lock file is made beside a device, a FIFO or a directory."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise FormatError(f"{path}: is {describe_mode(mode)}, expected a regular .coli_kv file")


def open_locked(path: str, dims: Dims, kv_dtype: str, *, create: bool, io: Durability) -> OpenedFile:
    """The caller holds the writer lock. Raises NotFoundError (absent, no create),
    FormatError (not a regular file, changed while opening, empty, bad header, rows of another
    kv dtype than a v1 file's upgrade), ModelMismatchError (other dims)."""
    _upgrade.remove_stale_temps(path, io)
    _remove_stale_create(path, io)
    created = False
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        if not create:
            raise NotFoundError(f"{path}: no such file (create=False)") from None
        _create_empty(path, target_header(kv_dtype, dims), io)
        created = True
        before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise FormatError(f"{path}: is {describe_mode(before.st_mode)}, expected a regular .coli_kv file")
    fd = open_regular(path, os.O_RDWR | os.O_NONBLOCK, same_as=before, opener=io.open)
    try:
        st = os.fstat(fd)
        if st.st_size == 0:
            raise FormatError(f"{path}: empty file (0 bytes): no .coli_kv header")
        header = parse_header(os.pread(fd, HEADER_SIZE, 0), st.st_size, path)
        if header.dims != dims:
            raise ModelMismatchError(
                f"{path}: file dims {header.dims.as_tuple()} (n_layers, kv_lora, qk_rope, "
                f"index_head_dim, n_index_layers, vocab) differ from the model's {dims.as_tuple()}")
        if header.notes:
            raise FormatError(
                f"{path}: {header.notes[0]}; refusing to append to a header this implementation "
                "never writes (`coli-kv convert` rewrites the file canonically)")
        refuse_other_rows(path, header, kv_dtype)
    except BaseException:
        os.close(fd)
        raise
    return OpenedFile(fd, header, int(st.st_size), created)


def target_header(kv_dtype: str, dims: Dims, nrec: int = 0) -> Header:
    """The header of a file holding ``kv_dtype`` rows (FORMAT.md 1.1: version and tag)."""
    version, tag = KV_FORMAT_OF_DTYPE[kv_dtype]
    return Header(version, dims, nrec, tag)


def refuse_other_rows(path: str, header: Header, kv_dtype: str) -> None:
    """A writer keeps a file's rows as they are, except that a v1 file is upgraded (crash-safely)
    when fp8 or the 4-bit tier is on. Any other pairing is refused with the way out (FORMAT.md 3.2)."""
    if header.version == 1 or header.kv_dtype == kv_dtype:
        return
    target = target_header(kv_dtype, header.dims)
    to = f"v{target.version}" + (f" --tq-bits {target.codec.bits} --tq-codec {target.codec.kind}"
                                 if target.codec is not None else "")
    raise FormatError(
        f"{path}: a v{header.version} ({header.kv_dtype}) file but kv_dtype is {kv_dtype!r}: a writer "
        f"keeps the file's rows; convert it with `coli-kv convert --to {to}` or open it as "
        f"{header.kv_dtype}")


def _create_empty(path: str, header: Header, io: Durability) -> None:
    """A new file with nrec 0, created whole: temp, fsync, rename, fsync the directory."""
    tmp = path + CREATE_SUFFIX
    fd = open_regular(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644, opener=io.open)
    try:
        io.pwrite(fd, pack_header(header), 0)
        io.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            io.unlink(tmp)
        except OSError:
            pass  # removed at the next open
        raise
    os.close(fd)
    io.replace(tmp, path)
    io.fsync_dir(path)
    log.info("kv.create", path=path, version=header.version, dims=header.dims.as_tuple())


def _remove_stale_create(path: str, io: Durability) -> None:
    tmp = path + CREATE_SUFFIX
    if os.path.lexists(tmp):
        io.unlink(tmp)
        log.warning("kv.recovery", path=path, action="removed stale create temp file", file=tmp)


__all__ = ["CREATE_SUFFIX", "OpenedFile", "open_locked", "refuse_non_regular", "refuse_other_rows",
           "target_header"]
