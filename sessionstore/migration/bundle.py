"""The migration bundle: one session's files as a stream, written and read front to back.

No seek anywhere, so a bundle flows through pipes (``export - | ssh host import -``). Layout
(little-endian; FORMAT.md section 6 is the spec)::

    preamble   16 B   magic b"COLIBNDL", u32 format version (1), u32 flags (0)
    manifest   16 B   b"MNFT", u32 json_len, u64 xxh3_64(json)   + json_len bytes of UTF-8 JSON
    chunks     24 B   b"CHNK", u16 file, u8 codec, u8 0, u32 raw_len, u32 stored_len,
                      u64 xxh3_64(raw, seed=chunk ordinal)       + stored_len payload bytes
    file end   32 B   b"FEND", u16 file, u16 0, u64 size, 16s xxh3_128(file)   (after each file)
    trailer    48 B   b"TRLR", u32 n_files, u64 n_chunks, u64 raw_bytes, 16s xxh3_128 of the
                      framing (preamble, manifest frame, every chunk header and file-end frame:
                      each header holds its chunk's checksum, so this digest binds every byte),
                      b"COLIBEND"

Files follow the manifest's order; file i of ``size`` bytes is exactly ceil(size/chunk_bytes)
chunks, each ``min(chunk_bytes, left)`` raw bytes, then its file-end frame. The writer hashes
each byte once as it streams (one pass, no seek): chunk checks and the whole-file digest come
from the same read. Every declared size is checked against a named limit before anything is
allocated; zstd payloads must declare their content size and decompress to exactly ``raw_len``
bytes (no bomb); the JSON is parsed, never executed.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import xxhash
import zstandard

from kernels.errors import CorruptionError, FormatError, LimitError
from sessionstore.migration.bundle_compress import CompressionPolicy
from sessionstore.migration.bundle_format import (
    BUNDLE_END_MAGIC,
    BUNDLE_MAGIC,
    BUNDLE_VERSION,
    CHUNK_HEAD,
    CHUNK_TAG,
    CODEC_RAW,
    CODEC_ZSTD,
    CODECS,
    FILE_END,
    FILE_END_TAG,
    MANIFEST_HEAD,
    MANIFEST_TAG,
    MAX_MANIFEST_BYTES,
    MAX_WINDOW_BYTES,
    PREAMBLE,
    TRAILER,
    TRAILER_TAG,
    BundleManifest,
    BundleStats,
    parse_json,
    validate_manifest_doc,
)
from sessionstore.migration.bundle_io import read_exactly_into


# --- writer --------------------------------------------------------------------------------------
def cut_chunks(pieces: Iterable[bytes | bytearray | memoryview], chunk_bytes: int
               ) -> Iterator[bytes | bytearray | memoryview]:
    """Re-cut a stream of pieces (any sizes) into chunks of ``chunk_bytes`` (the last shorter).
    Whole chunks inside a piece are zero-copy views; only chunks straddling pieces are copied."""
    buf = bytearray()
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if buf:
            take = min(chunk_bytes - len(buf), len(view))
            buf += view[:take]
            view = view[take:]
            if len(buf) == chunk_bytes:
                yield buf
                buf = bytearray()
        while len(view) >= chunk_bytes:
            yield view[:chunk_bytes]
            view = view[chunk_bytes:]
        if len(view):
            buf += view
    if buf:
        yield buf


class BundleWriter:
    """Writes one bundle to a binary sink, front to back. Call ``write_file`` for every file of
    the manifest, in order, then ``finish``.

    One pass: each chunk is hashed (its xxh3_64, and the file's running xxh3_128) right before
    it is written, while it is hot in the cache. A file that streams more or fewer bytes than the
    manifest declared raises CorruptionError BEFORE the trailer, so a reader refuses the stream.
    """

    def __init__(self, sink: BinaryIO, manifest: BundleManifest,
                 policy: CompressionPolicy | None = None, progress: Any = None) -> None:
        self._sink = sink
        self.manifest = manifest
        self.policy = policy or CompressionPolicy()
        self.stats = BundleStats()
        self._progress = progress
        self._framing = xxhash.xxh3_128()
        self._next_file = 0
        doc = manifest.to_json()
        self._frame(PREAMBLE.pack(BUNDLE_MAGIC, BUNDLE_VERSION, 0))
        self._frame(MANIFEST_HEAD.pack(MANIFEST_TAG, len(doc), xxhash.xxh3_64_intdigest(doc)))
        self._frame(doc)

    def _frame(self, data: bytes) -> None:
        self._framing.update(data)
        self._emit(data)

    def _emit(self, data: bytes | bytearray | memoryview) -> None:
        start = self.policy.clock()
        self._sink.write(data)
        self.policy.note_sink(self.policy.clock() - start, len(data))
        self.stats.stored_bytes += len(data)

    def write_file(self, name: str, pieces: Iterable[bytes | bytearray | memoryview]) -> str:
        """Stream the next file's bytes (any piece sizes; chunk-sized views are not copied);
        returns its xxh3_128 (hex), which the file-end frame carries."""
        files = self.manifest.files
        if self._next_file >= len(files) or files[self._next_file].name != name:
            raise FormatError(f"bundle writer: {name!r} is not the next file of the manifest")
        entry, index = files[self._next_file], self._next_file
        whole = xxhash.xxh3_128()
        written = 0
        for chunk in cut_chunks(pieces, self.manifest.chunk_bytes):
            written += len(chunk)
            if written > entry.size:
                raise CorruptionError(
                    f"bundle writer: {name} grew past its declared {entry.size} bytes while "
                    "being exported (changed under us); bundle abandoned")
            whole.update(chunk)
            self._chunk(index, chunk, xxhash.xxh3_64_intdigest(chunk, seed=self.stats.chunks))
        if written != entry.size:
            raise CorruptionError(
                f"bundle writer: {name}: streamed {written} bytes, the manifest declared "
                f"{entry.size} (changed while exported); bundle abandoned")
        self._frame(FILE_END.pack(FILE_END_TAG, index, 0, written, whole.digest()))
        self._next_file += 1
        self.stats.files += 1
        return whole.hexdigest()

    def _chunk(self, index: int, raw: bytes | bytearray | memoryview, check: int) -> None:
        codec, payload = self.policy.encode(raw)
        self._frame(CHUNK_HEAD.pack(CHUNK_TAG, index, codec, 0, len(raw), len(payload), check))
        self._emit(payload)
        self.stats.chunks += 1
        self.stats.raw_bytes += len(raw)
        self.stats.zstd_chunks += codec == CODEC_ZSTD
        if self._progress is not None:
            self._progress.update(len(raw))

    def finish(self) -> BundleStats:
        """Write the trailer (only once every file is complete) and flush the sink."""
        if self._next_file != len(self.manifest.files):
            raise FormatError("bundle writer: finish() before every file was written")
        self._emit(TRAILER.pack(TRAILER_TAG, len(self.manifest.files), self.stats.chunks,
                                self.stats.raw_bytes, self._framing.digest(), BUNDLE_END_MAGIC))
        self._sink.flush()
        return self.stats


# --- reader --------------------------------------------------------------------------------------
class BundleReader:
    """Reads one bundle from a binary source, front to back, verifying as it goes.

    The constructor reads the preamble and the manifest frame; ``iter_file(name)`` yields each
    file's verified raw chunks (files in manifest order); ``finish`` checks the trailer and EOF.
    Errors name the source, the byte offset, and expected vs found. Raw payloads are read with
    ``readinto`` into one preallocated chunk buffer (bounded by the manifest's ``chunk_bytes``).
    """

    def __init__(self, source: BinaryIO, name: str = "<bundle>") -> None:
        self._src = source
        self.name = name
        self.offset = 0
        self.stats = BundleStats()
        self._framing = xxhash.xxh3_128()
        self._dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
        self._next_file = 0
        head = self._read(PREAMBLE.size, "preamble", framing=True)
        magic, version, flags = PREAMBLE.unpack(head)
        if magic != BUNDLE_MAGIC:
            raise FormatError(f"{name}: byte 0: magic {magic!r}, expected {BUNDLE_MAGIC!r} "
                              "(not a coli-kv session bundle)")
        if version != BUNDLE_VERSION:
            raise FormatError(f"{name}: byte 8: bundle format version {version} is not supported "
                              f"(this reader knows version {BUNDLE_VERSION})")
        if flags != 0:
            raise FormatError(f"{name}: byte 12: flags {flags:#x}, expected 0")
        at = self.offset
        tag, length, check = MANIFEST_HEAD.unpack(
            self._read(MANIFEST_HEAD.size, "manifest frame", framing=True))
        if tag != MANIFEST_TAG:
            raise FormatError(f"{name}: byte {at}: frame tag {tag!r}, expected {MANIFEST_TAG!r}")
        if not 0 < length <= MAX_MANIFEST_BYTES:
            raise LimitError(f"{name}: byte {at + 4}: manifest length {length} outside "
                             f"1..{MAX_MANIFEST_BYTES}")
        doc = self._read(length, "manifest JSON", framing=True)
        found = xxhash.xxh3_64_intdigest(doc)
        if found != check:
            raise CorruptionError(f"{name}: byte {at + 8}: manifest checksum {check:#018x}, "
                                  f"computed {found:#018x}")
        self.manifest = validate_manifest_doc(parse_json(doc, f"{name}: manifest"), f"{name}: manifest")
        # one payload buffer, reused: a chunk at most (<= MAX_CHUNK_BYTES), or the largest file
        self._buffer = memoryview(bytearray(min(self.manifest.chunk_bytes,
                                                max(f.size for f in self.manifest.files))))

    def _read(self, n: int, what: str, framing: bool = False) -> bytes:
        """Exactly n bytes (n already bounded by the caller), or CorruptionError: truncated."""
        parts: list[bytes] = []
        got = 0
        while got < n:
            piece = self._src.read(n - got)
            if not piece:
                raise CorruptionError(
                    f"{self.name}: truncated at byte {self.offset + got}: {what} needs {n} bytes, "
                    f"the stream ended after {got}")
            parts.append(piece)
            got += len(piece)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if framing:
            self._framing.update(data)
        self.offset += n
        return data

    def _read_payload(self, n: int, what: str) -> memoryview:
        """Exactly n bytes (n <= chunk_bytes, checked by the caller) into the chunk buffer."""
        view = self._buffer[:n]
        got = read_exactly_into(self._src, view)
        if got < n:
            raise CorruptionError(
                f"{self.name}: truncated at byte {self.offset + got}: {what} needs {n} bytes, "
                f"the stream ended after {got}")
        self.offset += n
        return view

    def iter_file(self, name: str, *, copy: bool = True) -> Iterator[bytes | memoryview]:
        """The next file's raw bytes, chunk by chunk, each verified; the file-end frame (size
        and whole-file xxh3_128) is checked before the last chunk is yielded.

        ``copy=False`` yields views into the reader's chunk buffer, valid only until the next
        chunk is requested (no allocation per chunk: what an import writes straight to disk).
        """
        files = self.manifest.files
        if self._next_file >= len(files) or files[self._next_file].name != name:
            raise FormatError(f"{self.name}: {name!r} is not the next file of the bundle")
        index, entry = self._next_file, files[self._next_file]
        cb = self.manifest.chunk_bytes
        whole = xxhash.xxh3_128()
        left = entry.size
        if not left:
            self._file_end(index, entry.name, 0, whole)
        while left:
            raw = self._chunk(index, min(cb, left))
            whole.update(raw)
            left -= len(raw)
            if not left:
                self._file_end(index, entry.name, entry.size, whole)
            yield bytes(raw) if copy and not isinstance(raw, bytes) else raw
        self._next_file += 1
        self.stats.files += 1

    def _file_end(self, index: int, name: str, size: int, whole: Any) -> None:
        at = self.offset
        tag, file_index, reserved, found_size, digest = FILE_END.unpack(
            self._read(FILE_END.size, f"file-end frame of {name}", framing=True))
        where = f"{self.name}: byte {at}: file-end frame of {name}"
        if tag != FILE_END_TAG or file_index != index or reserved != 0:
            raise CorruptionError(f"{where}: tag {tag!r}, file {file_index}, reserved {reserved}; "
                                  f"expected {FILE_END_TAG!r}, {index}, 0")
        if found_size != size:
            raise CorruptionError(f"{where}: size {found_size}, the manifest declares {size}")
        if digest != whole.digest():
            raise CorruptionError(f"{where}: whole-file xxh3_128 {digest.hex()}, computed "
                                  f"{whole.hexdigest()} over the {size} bytes received")

    def _chunk(self, index: int, expect_raw: int) -> bytes | memoryview:
        at = self.offset
        ordinal = self.stats.chunks
        tag, file_index, codec, reserved, raw_len, stored_len, check = CHUNK_HEAD.unpack(
            self._read(CHUNK_HEAD.size, f"chunk {ordinal} header", framing=True))
        where = f"{self.name}: byte {at}: chunk {ordinal}"
        if tag != CHUNK_TAG:
            raise CorruptionError(f"{where}: frame tag {tag!r}, expected {CHUNK_TAG!r}")
        if file_index != index:
            raise CorruptionError(f"{where}: file index {file_index}, expected {index}")
        if codec not in CODECS or reserved != 0:
            raise FormatError(f"{where}: codec {codec} / reserved {reserved}: expected codec "
                              f"0 (raw) or 1 (zstd) and reserved 0")
        if raw_len != expect_raw:
            raise CorruptionError(f"{where}: raw length {raw_len}, expected {expect_raw}")
        if codec == CODEC_RAW and stored_len != raw_len:
            raise CorruptionError(f"{where}: raw chunk stores {stored_len} bytes, expected {raw_len}")
        if codec == CODEC_ZSTD and not 0 < stored_len < raw_len:
            raise CorruptionError(
                f"{where}: zstd chunk stores {stored_len} bytes, expected 1..{raw_len - 1}")
        payload = self._read_payload(stored_len, f"chunk {ordinal} payload")
        raw = self._inflate(payload, raw_len, where) if codec == CODEC_ZSTD else payload
        found = xxhash.xxh3_64_intdigest(raw, seed=ordinal)
        if found != check:
            raise CorruptionError(f"{where}: checksum {check:#018x}, computed {found:#018x} "
                                  f"over {raw_len} raw bytes")
        self.stats.chunks += 1
        self.stats.raw_bytes += raw_len
        self.stats.zstd_chunks += codec == CODEC_ZSTD
        return raw

    def _inflate(self, payload: memoryview, raw_len: int, where: str) -> bytes:
        try:
            declared = zstandard.frame_content_size(payload)
        except zstandard.ZstdError:
            declared = -2  # not a zstd frame header at all
        if declared != raw_len:
            raise CorruptionError(f"{where}: zstd frame declares {declared} content bytes, "
                                  f"expected {raw_len}")
        try:
            raw = self._dctx.decompress(payload, max_output_size=raw_len, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CorruptionError(f"{where}: zstd payload does not decompress: {exc}") from None
        if len(raw) != raw_len:
            raise CorruptionError(f"{where}: zstd payload gave {len(raw)} bytes, expected {raw_len}")
        return raw

    def finish(self) -> BundleStats:
        """Check the trailer against what was read, and that the stream ends right after it."""
        if self._next_file != len(self.manifest.files):
            raise FormatError(f"{self.name}: finish() before every file was read")
        at = self.offset
        tag, n_files, n_chunks, raw_bytes, digest, end = TRAILER.unpack(
            self._read(TRAILER.size, "trailer"))
        where = f"{self.name}: byte {at}: trailer"
        if tag != TRAILER_TAG or end != BUNDLE_END_MAGIC:
            raise CorruptionError(f"{where}: tags {tag!r}/{end!r}, expected "
                                  f"{TRAILER_TAG!r}/{BUNDLE_END_MAGIC!r}")
        expected = (len(self.manifest.files), self.stats.chunks, self.stats.raw_bytes)
        if (n_files, n_chunks, raw_bytes) != expected:
            raise CorruptionError(f"{where}: counts files/chunks/bytes {(n_files, n_chunks, raw_bytes)}"
                                  f", read {expected}")
        if digest != self._framing.digest():
            raise CorruptionError(f"{where}: framing xxh3_128 {digest.hex()}, computed "
                                  f"{self._framing.hexdigest()}")
        if self._src.read(1):
            raise FormatError(f"{self.name}: byte {self.offset}: data after the trailer "
                              "(a bundle ends with its trailer)")
        self.stats.files = n_files
        self.stats.stored_bytes = self.offset
        return self.stats


__all__ = ["BundleWriter", "BundleReader", "cut_chunks"]
