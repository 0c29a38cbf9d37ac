"""A resident session's per-commit state, ``manifest.json.state``, overwritten in place.

Every commit changes the manifest's dynamic fields (``committed``, ``pending``,
``last_logits``, ``updated_at``). Replacing the whole ``manifest.json`` for that costs a temp
file, a rename and the release of the old file's blocks (a discard on some disks), for fields
that FORMAT.md section 5 makes a verified cache anyway. So a commit overwrites one 4 KiB page of this
file instead; :func:`sessionstore.sessions.manifest.read_manifest` applies it (``apply_state``) when
its epoch equals the manifest's. A torn, damaged or absent page is ignored: the manifest's own
fields (an older commit of the same epoch, a valid lower bound) are used, and recovery does the rest.

The page's bytes are FORMAT.md 5.3.1 (magic, version, payload length, compact JSON payload,
xxh3_64 of what precedes it, zeros to 4096 bytes).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Protocol

import xxhash

from kernels.errors import FormatError, LimitError
from sessionstore.kvfile import open_regular, pwrite_all
from sessionstore.sessions.digest import LogitsDigest, digest_from_json, digest_to_json
from sessionstore.sessions.fields import need, need_int, pending_from_json

STATE_SUFFIX = ".state"
STATE_MAGIC = b"COLIMST1"
STATE_VERSION = 1
STATE_BYTES = 4096
_HEAD = struct.Struct("<8sII")
_CHECK = struct.Struct("<Q")
MAX_PAYLOAD = STATE_BYTES - _HEAD.size - _CHECK.size


class CommitFields(Protocol):
    """What a page holds of a manifest (a :class:`sessionstore.sessions.manifest.Manifest` is one)."""

    @property
    def epoch(self) -> int: ...
    @property
    def committed(self) -> int: ...
    @property
    def pending(self) -> list[int]: ...
    @property
    def last_logits(self) -> LogitsDigest | None: ...
    @property
    def updated_at(self) -> str: ...


def state_path(manifest_path: str | os.PathLike[str]) -> Path:
    """``<manifest path>.state``."""
    return Path(os.fspath(manifest_path) + STATE_SUFFIX)


def encode_state(manifest: CommitFields) -> bytes:
    """The 4096-byte page holding ``manifest``'s epoch and dynamic fields."""
    payload = json.dumps({"epoch": manifest.epoch, "committed": manifest.committed,
                          "pending": list(manifest.pending),
                          "last_logits": digest_to_json(manifest.last_logits),
                          "updated_at": manifest.updated_at},
                         separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    if len(payload) > MAX_PAYLOAD:
        raise LimitError(f"commit state of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    body = _HEAD.pack(STATE_MAGIC, STATE_VERSION, len(payload)) + payload
    page = body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))
    return page + bytes(STATE_BYTES - len(page))


def decode_state(page: bytes, vocab: int, where: str) -> dict[str, Any]:
    """The validated fields of a page; FormatError when torn, damaged or malformed."""
    if len(page) < _HEAD.size:
        raise FormatError(f"{where}: {len(page)} bytes, shorter than the {_HEAD.size}-byte head")
    magic, version, length = _HEAD.unpack_from(page)
    if magic != STATE_MAGIC or version != STATE_VERSION:
        raise FormatError(f"{where}: byte 0: magic {magic!r} version {version}, expected "
                          f"{STATE_MAGIC!r} version {STATE_VERSION}")
    if length > MAX_PAYLOAD or len(page) < _HEAD.size + length + _CHECK.size:
        raise FormatError(f"{where}: byte 12: payload length {length} beyond the page")
    end = _HEAD.size + length
    (check,) = _CHECK.unpack_from(page, end)
    if check != xxhash.xxh3_64_intdigest(page[:end]):
        raise FormatError(f"{where}: byte {end}: check does not match (torn or damaged)")
    try:
        data = json.loads(page[_HEAD.size:end].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{where}: byte 16: payload is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FormatError(f"{where}: byte 16: payload is not a JSON object")
    return {"epoch": need_int(data, "epoch", where, 0, (1 << 63) - 1),
            "committed": need_int(data, "committed", where),
            "pending": pending_from_json(data, vocab, where),
            "last_logits": digest_from_json(data, vocab, where),
            "updated_at": need(data, "updated_at", str, where)}


def read_state_page(manifest_path: str | os.PathLike[str]) -> bytes | None:
    """The state page beside a manifest; None when absent (never follows a symlink)."""
    path = state_path(manifest_path)
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_NONBLOCK, what="commit state")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FormatError(f"{path}: cannot open the commit state ({exc.strerror})") from None
    try:
        return os.pread(fd, STATE_BYTES, 0)
    finally:
        os.close(fd)


class StateWriter:
    """Overwrites the state page of one manifest in place (one descriptor, kept open)."""

    def __init__(self, manifest_path: str | os.PathLike[str]) -> None:
        self.path = state_path(manifest_path)
        self._fd = -1

    def open(self) -> None:
        """Open (create) the page now, e.g. when the session becomes resident; ``write`` opens
        it on first use otherwise."""
        if self._fd < 0:
            self._fd = _open_state(self.path, create=True)

    def write(self, manifest: CommitFields, *, durable: bool = False) -> None:
        """One 4096-byte ``pwrite`` at offset 0 (``durable``: then fdatasync)."""
        self.write_page(encode_state(manifest), durable=durable)

    def write_page(self, page: bytes, *, durable: bool = False) -> None:
        """Write a page :func:`encode_state` made (e.g. on a helper thread, ahead of time)."""
        if len(page) != STATE_BYTES:
            raise LimitError(f"{self.path}: a state page is {STATE_BYTES} bytes, not {len(page)}")
        self.open()
        pwrite_all(self._fd, page, 0, str(self.path))
        if durable:
            os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def update_existing_state(manifest_path: str | os.PathLike[str], manifest: CommitFields) -> bytes | None:
    """Before a whole manifest is replaced: give an existing state page the same values, so it
    never overrides the new manifest with older ones. Returns the page's bytes as they were, for
    :func:`put_back_state` should the replace fail (no page: nothing done, None)."""
    path = state_path(manifest_path)
    try:
        fd = _open_state(path, create=False)
    except FileNotFoundError:
        return None
    try:
        before = os.pread(fd, STATE_BYTES + 1, 0)
        pwrite_all(fd, encode_state(manifest), 0, str(path))
    finally:
        os.close(fd)
    return before


def put_back_state(manifest_path: str | os.PathLike[str], before: bytes) -> None:
    """Give the state page the bytes :func:`update_existing_state` found (FORMAT.md 5.3.1: a
    whole manifest write that failed before its rename leaves the page as it was). An overwrite
    in place needs no new block, so a full disk does not refuse it."""
    path = state_path(manifest_path)
    fd = _open_state(path, create=False)
    try:
        pwrite_all(fd, before, 0, str(path))
        os.ftruncate(fd, len(before))  # a page shorter than STATE_BYTES (torn, or never written) stays so
    finally:
        os.close(fd)


def _open_state(path: Path, *, create: bool) -> int:
    flags = os.O_RDWR | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    return open_regular(path, flags, 0o644, what="commit state")


__all__ = ["STATE_SUFFIX", "STATE_MAGIC", "STATE_BYTES", "CommitFields", "state_path", "encode_state",
           "decode_state", "read_state_page", "StateWriter", "update_existing_state",
           "put_back_state"]
