"""Copy the committed prefix of a ``.coli_kv`` file (and its sidecar) into a new file.

Used by fork, snapshot copies and slot export. The kv bytes are cloned with a reflink
(``FICLONE``) where the filesystem has one (btrfs, xfs, ...), else copied in the kernel with
``os.copy_file_range``, else read and written in chunks; then the header is rewritten with the
wanted commit word and the file is cut to exactly the committed bytes. The sidecar entries are
COPIED from the source (not recomputed), so a later check compares the copied records with the
checksums the source vouched for.
"""
from __future__ import annotations

import errno
import fcntl
import os

from kernels.errors import CorruptionError
from sessionstore.kvfile.fsio import open_regular, pwrite_all, write_all
from sessionstore.kvfile.header import Header, pack_header
from sessionstore.kvfile.reader import open_kv, open_regular_file
from sessionstore.kvfile.sidecar import ENTRY_SIZE, SIDECAR_HEADER_SIZE, SidecarWriter, load_sidecar, sidecar_path
from sessionstore.log import get_logger

FICLONE = 0x40049409  # _IOW(0x94, 9, int)
COPY_CHUNK = 8 << 20

log = get_logger("copy")


def _clone(src_fd: int, dst_fd: int) -> bool:
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return True
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS,
                         errno.EPERM, errno.EBADF):
            return False
        raise


def _copy_range(src_fd: int, dst_fd: int, nbytes: int) -> str:
    """Copy bytes [0, nbytes) from src to dst; returns the method used."""
    done = 0
    method = "copy_file_range"
    while done < nbytes:
        if method == "copy_file_range":
            try:
                n = os.copy_file_range(src_fd, dst_fd, nbytes - done, done, done)
            except OSError as exc:
                if exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    method = "copy"
                    continue
                raise
        else:
            chunk = os.pread(src_fd, min(COPY_CHUNK, nbytes - done), done)
            n = len(chunk)
            if n:
                pwrite_all(dst_fd, chunk, done)
        if n <= 0:
            raise CorruptionError(f"source ended at byte {done}, expected {nbytes} bytes")
        done += n
    return method


def copy_committed(src: str | os.PathLike[str], dst: str | os.PathLike[str], header: Header) -> str:
    """Write ``dst`` (new file) = ``src``'s first ``header.nrec`` records under ``header``.

    Returns "reflink", "copy_file_range" or "copy". ``dst`` is fsynced (not its directory).
    """
    nbytes = header.committed_end()
    src_fd, st = open_regular_file(src)
    try:
        if st.st_size < nbytes:
            raise CorruptionError(f"{src}: {st.st_size} bytes, expected at least {nbytes} "
                                  f"({header.nrec} records)")
        dst_fd = open_regular(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if _clone(src_fd, dst_fd):
                method = "reflink"
                os.ftruncate(dst_fd, nbytes)
            else:
                method = _copy_range(src_fd, dst_fd, nbytes)
            pwrite_all(dst_fd, pack_header(header), 0)
            os.fsync(dst_fd)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    log.info("kv.copy", src=os.fspath(src), dst=os.fspath(dst), records=header.nrec, method=method)
    return method


def copy_sidecar_prefix(src_kv: str | os.PathLike[str], dst_kv: str | os.PathLike[str],
                        header: Header) -> int:
    """Give ``dst_kv`` a sidecar vouching for its ``header.nrec`` records.

    Entries the source's sidecar holds are copied; records it does not cover (an engine-written
    file) are hashed from ``dst_kv``. Returns how many entries were copied.
    """
    n = header.nrec
    copied = 0
    source = load_sidecar(src_kv)
    if source is not None:
        keep = min(source.available, n)
        src_fd, _ = open_regular_file(sidecar_path(src_kv))
        try:
            raw = os.pread(src_fd, SIDECAR_HEADER_SIZE + ENTRY_SIZE * keep, 0)
        finally:
            os.close(src_fd)
        fd = open_regular(sidecar_path(dst_kv), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, raw)
        finally:
            os.close(fd)
    with SidecarWriter(dst_kv, header) as writer:  # keeps the copy if it matches the header
        copied = writer.count
        if writer.count > n:
            writer.set_count(n)
            copied = n
        elif writer.count < n:
            with open_kv(dst_kv, expect=header.dims) as reader:
                writer.stage(writer.count, reader.records_bytes_view(writer.count, n))
        writer.fsync()
    return copied


__all__ = ["copy_committed", "copy_sidecar_prefix", "FICLONE"]
