"""Checksums beside a ``.coli_kv`` file (``<path>.colisum``); never inside the engine's bytes.

The layout is FORMAT.md 4.1 (a 64-byte header, then one xxh3_64 entry per record, seeded with
its position); writing 4.2, checking 4.3, reading for use 4.4 (:mod:`sessionstore.kvfile.integrity`).
Records vouched for are ``[0, min(count, nrec))``. The writer stages entries and the count,
fsyncs the sidecar together with the record data, and only then writes the kv commit word.
Bytes past entry ``count - 1`` (truncated entries, or the zero-filled headroom a preallocating
writer keeps) are never read.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kernels.errors import CorruptionError, FormatError, LimitError
from sessionstore.kvfile.fsio import Buffer, atomic_replace, fsync_parent, open_regular, pwrite_all
from sessionstore.kvfile.header import Header, pack_header, static_header_bytes
from sessionstore.log import get_logger

if TYPE_CHECKING:
    from sessionstore.kvfile.reader import KVReader

SIDECAR_SUFFIX = ".colisum"
TEMP_SUFFIX = ".tmp"
SIDECAR_MAGIC = b"COLISUM1"
SIDECAR_VERSION = 1
ALGO_XXH3_64 = 1
SIDECAR_HEADER_SIZE = 64
ENTRY_SIZE = 8
COUNT_OFFSET = 32
SIDECAR_STRUCT = struct.Struct("<8sIIQQQ16s")  # everything the header_check covers
CHECK_STRUCT = struct.Struct("<Q")
assert SIDECAR_STRUCT.size == 56
assert SIDECAR_STRUCT.size + CHECK_STRUCT.size == SIDECAR_HEADER_SIZE
HEADROOM_ENTRIES = 4096  # zero-filled entries (32 KiB) the kv writer's sidecar grows by


def sidecar_bound(records: int) -> int:
    """The most the kv writer's sidecar of a file of ``records`` records takes: its header, one
    entry per record and the zero-filled headroom it grows by, page-rounded (:meth:`SidecarWriter.append`)."""
    return SIDECAR_HEADER_SIZE + (records + HEADROOM_ENTRIES) * ENTRY_SIZE + 4096
CHECK_CHUNK_RECORDS = 4096  # records hashed per comparison chunk

log = get_logger("sidecar")


def sidecar_path(kv_path: str | os.PathLike[str]) -> str:
    """``<kv path>.colisum``."""
    return os.fspath(kv_path) + SIDECAR_SUFFIX


def record_checksum(buf: Buffer, position: int) -> int:
    """xxh3_64 of one record's bytes, seeded with its position (a moved record does not match)."""
    return xxhash.xxh3_64_intdigest(buf, seed=position)


NOGIL_MIN_BYTES = 256 << 10  # records hashed by the compiled kernel from this many bytes a call (see below)


class HashingPolicy:
    """Whether this process may hash records with the compiled kernel (:func:`record_checksums`). A
    server's API process computes nothing and loads no compiled code (numba, llvmlite: its memory and
    start), so it turns it off (:func:`hash_without_compiled_code`) and hashes what it checks (a bundle
    export's records) with the ``xxhash`` binding, the GIL held, as before the kernel existed."""

    compiled = True


def hash_without_compiled_code() -> None:
    """From now on this process hashes records with the ``xxhash`` binding only (see :class:`HashingPolicy`)."""
    HashingPolicy.compiled = False


def record_checksums(buf: Buffer, record_bytes: int, first_position: int) -> np.ndarray:
    """:func:`record_checksum` of each of the ``k`` records in ``buf`` (k * record_bytes bytes),
    record i seeded with ``first_position + i``: [k] <u8.

    From NOGIL_MIN_BYTES a call, one compiled call without the GIL (:func:`kernels.xxh3.xxh3_64_rows`,
    bit-exact xxh3_64 at xxhash's speed): the ``xxhash`` binding keeps the GIL for an input under
    about 100 KB (a GLM-5.2 record is 45.5 KB) and a loop of its calls keeps it between calls, so a
    thread of a server hashing a session's records stalled every other thread of the process for the
    whole pass (a probe's ``os.stat`` 2.4 us alone, ~790 us beside it). Below it, the binding
    (at most ~20 us with the GIL held; a small commit need not load numba)."""
    view = memoryview(buf).cast("B")
    if record_bytes <= 0 or len(view) % record_bytes:
        raise FormatError(f"{len(view)} bytes are not whole records of {record_bytes} bytes")
    k = len(view) // record_bytes
    if len(view) >= NOGIL_MIN_BYTES and HashingPolicy.compiled:
        from kernels.xxh3 import xxh3_64_rows  # numba: loaded by the first large pass only
        return xxh3_64_rows(np.frombuffer(view, np.uint8).reshape(k, record_bytes), first_position)
    out = np.empty(k, dtype="<u8")  # [k] u64
    for i in range(k):
        out[i] = xxhash.xxh3_64_intdigest(view[i * record_bytes:(i + 1) * record_bytes], seed=first_position + i)
    return out


def warm_record_hashing() -> None:
    """Load :func:`record_checksums`' compiled kernel now (numba and its cached code, about 0.5 s
    with the GIL held): a server process calls it as it starts, so that its first large pass (a
    resume, an export's check) does not stall the process's other threads while it loads."""
    from kernels.xxh3 import xxh3_64_rows

    rows = np.zeros((1, 256), dtype=np.uint8)  # [1, 256] u8: the long path
    xxh3_64_rows(rows)
    rows.flags.writeable = False  # a mapping's records are read-only: numba's other signature
    xxh3_64_rows(rows)


def hash_records(reader: KVReader, start: int, stop: int) -> np.ndarray:
    """The checksums of committed records [start, stop) of ``reader``: [stop - start] <u8.

    One pass over the mapping at xxh3's speed (~13 GB/s a core, the raw read's speed here), with
    the GIL released (:func:`record_checksums`): the process's other threads go on meanwhile. Two
    threads each hashing half were no faster on the 2-vCPU development host, its other vCPU shared
    with other work (0.75 GB of records in memory: 75 -> 82 ms, and 89 -> 93 ms at nice -5; a
    32k-token GLM-5.2-shaped resume's pass 189 -> 242 ms; medians of 9, alternated), so the loop
    stays on one core. An idle or many-core host was not measured."""
    return record_checksums(reader.records_bytes_view(start, stop), reader.record_bytes, start)


def static_hash(kv_header_bytes: bytes) -> int:
    """xxh3_64 of the kv header without its commit word."""
    return xxhash.xxh3_64_intdigest(static_header_bytes(kv_header_bytes))


def _pack_sidecar_header(static: int, record_bytes: int, count: int) -> bytes:
    body = SIDECAR_STRUCT.pack(SIDECAR_MAGIC, SIDECAR_VERSION, ALGO_XXH3_64, static,
                               record_bytes, count, b"\0" * 16)
    return body + CHECK_STRUCT.pack(xxhash.xxh3_64_intdigest(body))


def temp_path_for(path: str | os.PathLike[str]) -> str:
    """The ONE temp name used while replacing ``path``: ``<path>.tmp``. A deterministic name
    lets the next writer (holding the file's lock) recognise and remove one a crash left."""
    return os.fspath(path) + TEMP_SUFFIX


def create_temp_for(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Open a fresh ``<path>.tmp`` for writing (a stale one from a crash is removed first)."""
    tmp = temp_path_for(path)
    if os.path.lexists(tmp):
        os.unlink(tmp)
    return open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), tmp


def remove_stale_temp(path: str | os.PathLike[str]) -> bool:
    """Remove a ``<path>.tmp`` left by a crash; True if there was one."""
    tmp = temp_path_for(path)
    if os.path.lexists(tmp):
        os.unlink(tmp)
        log.info("temp.removed", path=tmp)
        return True
    return False


@dataclass(frozen=True)
class Sidecar:
    """A loaded, header-checked sidecar. ``entries`` [available] <u8 (a copy, 8 B per record)."""

    path: str
    static_hash: int
    record_bytes: int
    count: int
    entries: np.ndarray  # [min(count, entries on disk)] <u8

    @property
    def available(self) -> int:
        return int(self.entries.shape[0])


def load_sidecar(kv_path: str | os.PathLike[str]) -> Sidecar | None:
    """Load ``<kv_path>.colisum``; None when absent or empty (it vouches for nothing either way).
    A damaged sidecar raises CorruptionError."""
    path = sidecar_path(kv_path)
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size == 0:
            return None  # created, then a crash before its header was durable: nothing vouched
        head = os.pread(fd, SIDECAR_HEADER_SIZE, 0)
        if len(head) < SIDECAR_HEADER_SIZE:
            raise CorruptionError(
                f"{path}: sidecar header is {len(head)} bytes, expected {SIDECAR_HEADER_SIZE}")
        magic, version, algo, static, rec_bytes, count, _ = SIDECAR_STRUCT.unpack(head[:56])
        (check,) = CHECK_STRUCT.unpack(head[56:])
        if magic != SIDECAR_MAGIC:
            raise CorruptionError(f"{path}: byte 0: magic {magic!r}, expected {SIDECAR_MAGIC!r}")
        found = xxhash.xxh3_64_intdigest(head[:56])
        if check != found:
            raise CorruptionError(
                f"{path}: byte 56: sidecar header check {check:#018x}, computed {found:#018x}")
        if version != SIDECAR_VERSION or algo != ALGO_XXH3_64:
            raise FormatError(f"{path}: sidecar version {version} / algo {algo} not supported")
        on_disk = max(st.st_size - SIDECAR_HEADER_SIZE, 0) // ENTRY_SIZE
        available = min(count, on_disk)  # bounded by the file: never allocate past it
        raw = os.pread(fd, available * ENTRY_SIZE, SIDECAR_HEADER_SIZE)
        entries = np.frombuffer(raw, dtype="<u8")  # [available] u64
        return Sidecar(path, static, rec_bytes, count, entries)
    finally:
        os.close(fd)


class SidecarWriter:
    """Write side of the sidecar, driven by the kv writer's commit protocol.

    Opening keeps an existing sidecar that matches ``header`` (static fields and record size).
    An absent (or empty) one is created in place with count 0; a damaged one or one of another
    header is replaced atomically (``<sidecar>.tmp``, fsync, rename, fsync dir). A stale
    ``<sidecar>.tmp`` from a crash is removed (the caller holds the kv file's writer lock).
    """

    def __init__(self, kv_path: str | os.PathLike[str], header: Header, *,
                 headroom_entries: int = 0) -> None:
        self.path = sidecar_path(kv_path)
        self.headroom_entries = headroom_entries  # zero entries added whenever the file grows
        self.kv_path = os.fspath(kv_path)
        self.record_bytes = header.record_bytes
        self.static_hash = static_hash(pack_header(header.with_nrec(0)))
        self.count = 0
        existing = None
        remove_stale_temp(self.path)  # the caller holds the kv file's writer lock
        try:
            existing = load_sidecar(kv_path)
            reason = "absent" if existing is None else "header differs"
        except (CorruptionError, FormatError) as exc:
            reason = f"damaged: {exc}"
        if (existing is not None and existing.static_hash == self.static_hash
                and existing.record_bytes == self.record_bytes):
            self.count = min(existing.count, existing.available)
        elif existing is None and reason == "absent":
            self._create_new()
            log.info("sidecar.create", path=self.path, reason=reason)
        else:
            self._replace_with_fresh()
            log.info("sidecar.create", path=self.path, reason=reason)
        self._fd = open_regular(self.path, os.O_RDWR)
        self._file_end = int(os.fstat(self._fd).st_size)  # grows only (zero-filled headroom)
        if existing is not None and self.count != existing.count:
            self._write_header()  # entries cut short: vouch only for those present

    def _fresh_header(self) -> bytes:
        return _pack_sidecar_header(self.static_hash, self.record_bytes, 0)

    def _create_new(self) -> None:
        """No sidecar yet: create it in place (no temp). An empty file a crash left is replaced."""
        if os.path.lexists(self.path):
            os.unlink(self.path)  # the empty sidecar load_sidecar reported as absent
        fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, self._fresh_header())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_parent(self.path)

    def _replace_with_fresh(self) -> None:
        """A damaged or foreign sidecar: replace it atomically through ``<sidecar>.tmp``."""
        atomic_replace(self.path, self._fresh_header(), make_temp=create_temp_for)

    def _write_header(self) -> None:
        pwrite_all(self._fd, _pack_sidecar_header(self.static_hash, self.record_bytes, self.count), 0, self.path)

    def fileno(self) -> int:
        return self._fd

    def stage(self, first_position: int, records_bytes: Buffer) -> int:
        """Hash the records at ``first_position..`` and write their entries and the new count.

        No fsync (the commit protocol fsyncs). Returns the new count.
        """
        if first_position < 0 or first_position > self.count:
            raise LimitError(
                f"{self.path}: stage at position {first_position} leaves a gap (count {self.count})")
        self.count = first_position + self.write_entries(first_position, records_bytes)
        self._write_header()
        return self.count

    def write_entries(self, first_position: int, records_bytes: Buffer) -> int:
        """Hash the records at ``first_position..`` and write their entries, leaving the count
        (what the sidecar vouches for) as it is: entries past it are never read, so a writer may
        write them ahead of its commit. No fsync. Returns the number of entries written."""
        view = memoryview(records_bytes).cast("B")
        rec = self.record_bytes
        if len(view) % rec:
            raise FormatError(
                f"{self.path}: staged {len(view)} bytes, not a multiple of the record size {rec}")
        if first_position < 0:
            raise LimitError(f"{self.path}: entry position {first_position} < 0")
        data = record_checksums(view, rec, first_position).tobytes()  # k u64 entries, little-endian
        offset = SIDECAR_HEADER_SIZE + ENTRY_SIZE * first_position
        end = offset + len(data)
        if end > self._file_end and self.headroom_entries > 0:  # growing: zero-filled headroom
            # in the same write, so the next commits overwrite allocated blocks and their
            # fdatasync has no metadata to commit; entries past ``count`` are never read
            target = -(-(end + ENTRY_SIZE * self.headroom_entries) // 4096) * 4096
            data += bytes(target - end)
        pwrite_all(self._fd, data, offset, self.path)
        self._file_end = max(self._file_end, offset + len(data))
        return len(view) // rec

    def publish(self, count: int) -> None:
        """Vouch for the first ``count`` entries (all written before): the header is rewritten."""
        if count < 0:
            raise LimitError(f"{self.path}: publish({count})")
        self.count = count
        self._write_header()

    def set_count(self, n: int) -> None:
        """Vouch for exactly the first ``n`` records (truncate); entries past ``n`` are ignored."""
        if n < 0 or n > self.count:
            raise LimitError(f"{self.path}: set_count({n}) outside [0, {self.count}]")
        self.count = n
        self._write_header()

    def fsync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SidecarWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sidecar_bytes(kv_header: bytes, rec_bytes: int, entries: np.ndarray) -> bytes:
    """A sidecar vouching for exactly ``entries`` (the committed prefix), per FORMAT.md section 4."""
    body = SIDECAR_STRUCT.pack(SIDECAR_MAGIC, SIDECAR_VERSION, ALGO_XXH3_64, static_hash(kv_header),
                               rec_bytes, int(entries.shape[0]), b"\0" * 16)
    head = body + CHECK_STRUCT.pack(xxhash.xxh3_64_intdigest(body))
    assert len(head) == SIDECAR_HEADER_SIZE
    return head + np.ascontiguousarray(entries, dtype="<u8").tobytes()


def write_sidecar_for(reader: KVReader) -> int:
    """Write a fresh sidecar vouching for every complete committed record of an open file."""
    with SidecarWriter(reader.path, reader.header) as writer:
        writer.set_count(0)
        step = max(1, (64 << 20) // reader.record_bytes)
        for start in range(0, reader.nrec, step):
            stop = min(start + step, reader.nrec)
            writer.stage(start, reader.records_bytes_view(start, stop))
        writer.fsync()
        return writer.count


def write_sidecar_atomic(kv_path: str | os.PathLike[str], header: Header,
                         entries: np.ndarray) -> str:
    """Write a complete sidecar (``entries`` [count] u64) for ``kv_path`` atomically."""
    path = sidecar_path(kv_path)
    entries = np.ascontiguousarray(entries, dtype="<u8")  # [count] u64
    head = _pack_sidecar_header(static_hash(pack_header(header.with_nrec(0))),
                                header.record_bytes, int(entries.shape[0]))
    atomic_replace(path, head + entries.tobytes(), make_temp=create_temp_for)
    return path


__all__ = [
    "SIDECAR_SUFFIX", "SIDECAR_MAGIC", "SIDECAR_HEADER_SIZE", "Sidecar", "SidecarWriter",
    "sidecar_bound", "sidecar_path", "record_checksum", "record_checksums", "static_hash", "load_sidecar",
    "hash_records", "warm_record_hashing", "HashingPolicy", "hash_without_compiled_code",
    "sidecar_bytes", "write_sidecar_for", "write_sidecar_atomic",
    "temp_path_for", "create_temp_for", "remove_stale_temp",
]
