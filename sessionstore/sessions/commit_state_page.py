"""A resident session's per-commit state, ``manifest.json.state``, overwritten in place.

Every commit changes the manifest's dynamic fields (``committed``, ``pending``,
``last_logits``, ``updated_at``). Replacing the whole ``manifest.json`` for that costs a temp
file, a rename and the release of the old file's blocks (a discard on some disks), for fields
that FORMAT.md section 5 makes a verified cache anyway. So a commit overwrites one 4 KiB page of this
file instead; :func:`sessionstore.sessions.manifest.read_manifest` applies it (``apply_state``) when
its epoch equals the manifest's. A torn, damaged or absent page is ignored: the manifest's own
fields (an older commit of the same epoch, a valid lower bound) are used, and recovery does the rest.

The page's bytes are FORMAT.md 5.3.1 (magic, version, payload length, compact JSON payload,
xxh3_64 of what precedes it, zeros to 4096 bytes). The file holds two such slots (offsets 0 and
4096), written alternately, each page numbered (``seq``): a write that a crash tears damages only
the slot it went to, never the other, which holds the last page whose write returned (a durable
stream's tail commit, :mod:`sessionstore.sessions.durable_text`, keeps tokens a client saw in
this page alone). A reader takes the sound slot of the manifest's epoch with the larger ``seq``.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
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
STATE_SLOTS = 2  # pages in the file, written alternately (slot i at offset i * STATE_BYTES)
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


def encode_state(manifest: CommitFields, seq: int = 0, *, logits_json: str | None = None) -> bytes:
    """The 4096-byte page holding ``manifest``'s epoch and dynamic fields, numbered ``seq``;
    LimitError when they do not fit. ``logits_json``: ``manifest.last_logits`` already encoded
    (:func:`logits_json_of`; a tail commit's digest is the same page after page). The payload is
    the compact, key-sorted JSON of FORMAT.md 5.3.1, written out field by field: a tail commit
    encodes one page per session per step, and ``json.dumps`` of the whole object cost ~4x more."""
    pending = manifest.pending
    if logits_json is None:
        logits_json = logits_json_of(manifest.last_logits)
    committed, epoch = manifest.committed, manifest.epoch
    if type(committed) is int and type(epoch) is int and type(seq) is int and all(type(t) is int for t in pending):
        ids = ",".join(map(str, pending))  # plain ints (what a page holds): written as json would
        payload = (f'{{"committed":{committed},"epoch":{epoch},"last_logits":{logits_json},'
                   f'"pending":[{ids}],"seq":{seq},"updated_at":{json.dumps(manifest.updated_at)}}}').encode()
    else:  # anything else: json's own rules (and its errors)
        payload = json.dumps({"epoch": manifest.epoch, "committed": manifest.committed, "pending": list(pending),
                              "last_logits": digest_to_json(manifest.last_logits),
                              "updated_at": manifest.updated_at, "seq": seq},
                             separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    if len(payload) > MAX_PAYLOAD:
        raise LimitError(f"commit state of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    body = _HEAD.pack(STATE_MAGIC, STATE_VERSION, len(payload)) + payload
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body)) + bytes(MAX_PAYLOAD - len(payload))


def logits_json_of(digest: LogitsDigest | None) -> str:
    """A page's ``last_logits`` value, compact key-sorted JSON (``null`` for None)."""
    return json.dumps(digest_to_json(digest), separators=(",", ":"), sort_keys=True, allow_nan=False)


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
            "updated_at": need(data, "updated_at", str, where),
            "seq": need_int(data, "seq", where, 0, (1 << 63) - 1) if "seq" in data else 0}


def newest_state(pages: bytes, vocab: int, where: str, epoch: int | None = None) -> dict[str, Any]:
    """The fields of the sound slot of ``pages`` (the file's bytes) with the largest ``seq``,
    among those of ``epoch`` when given; FormatError when no slot qualifies."""
    found: list[dict[str, Any]] = []
    errors: list[str] = []
    for slot in range(STATE_SLOTS):
        page = pages[slot * STATE_BYTES:(slot + 1) * STATE_BYTES]
        if not page:
            break
        try:
            state = decode_state(page, vocab, f"{where} (slot {slot})")
        except FormatError as exc:
            errors.append(str(exc))
            continue
        if epoch is None or state["epoch"] == epoch:
            found.append(state)
    if not found:
        raise FormatError("; ".join(errors) or f"{where}: no page of epoch {epoch}")
    return max(found, key=lambda state: state["seq"])


def read_state_page(manifest_path: str | os.PathLike[str]) -> bytes | None:
    """The state file's bytes beside a manifest (both slots); None when absent (never follows
    a symlink)."""
    path = state_path(manifest_path)
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_NONBLOCK, what="commit state")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FormatError(f"{path}: cannot open the commit state ({exc.strerror})") from None
    try:
        return os.pread(fd, STATE_SLOTS * STATE_BYTES, 0)
    finally:
        os.close(fd)


class StateWriter:
    """Overwrites the state pages of one manifest in place, the two slots in turn (one
    descriptor, kept open). Its pages are numbered on from the largest ``seq`` it found."""

    def __init__(self, manifest_path: str | os.PathLike[str], sync: Callable[[int], None] = os.fdatasync) -> None:
        self.path = state_path(manifest_path)
        self._sync = sync  # the barrier (a durability seam's ``fsync``: fdatasync; tests inject faults)
        self._fd = -1
        self._seq = 0  # the number of the last page written (or found)
        self._slot = 0  # the slot the next page goes to: never the one holding the newest
        self._logits: tuple[LogitsDigest | None, str] = (None, "null")  # the last digest and its JSON

    def open(self) -> None:
        """Open (create) the file now, e.g. when the session becomes resident; ``write`` opens
        it on first use otherwise. The next page goes to the slot not holding the newest one."""
        if self._fd < 0:
            self._fd = _open_state(self.path, create=True)
            self._seq, newest = 0, 1
            data = os.pread(self._fd, STATE_SLOTS * STATE_BYTES, 0)
            if len(data) < STATE_SLOTS * STATE_BYTES:  # both slots' blocks now: a page written later
                try:  # then overwrites in place, and a full disk cannot refuse it (zeros: no page)
                    pwrite_all(self._fd, bytes(STATE_SLOTS * STATE_BYTES - len(data)), len(data), str(self.path))
                except OSError:
                    pass  # a full disk: the slot is written (and its block taken) by a later page
            for slot in range(STATE_SLOTS):
                seq = _seq_of(data[slot * STATE_BYTES:(slot + 1) * STATE_BYTES])
                if seq is not None and seq >= self._seq:
                    self._seq, newest = seq, slot
            self._slot = (newest + 1) % STATE_SLOTS

    @property
    def seq(self) -> int:
        """The number the next page is given (:func:`encode_state`'s ``seq``)."""
        self.open()
        return self._seq + 1

    def encode(self, manifest: CommitFields) -> bytes:
        """:func:`encode_state` of ``manifest`` numbered :attr:`seq`; the JSON of its digest is
        kept from the page before when the digest is the same object (a tail commit's is)."""
        digest = manifest.last_logits
        if digest is not self._logits[0]:
            self._logits = (digest, logits_json_of(digest))
        return encode_state(manifest, self.seq, logits_json=self._logits[1])

    def write(self, manifest: CommitFields, *, durable: bool = False) -> None:
        """One 4096-byte ``pwrite`` to the next slot (``durable``: then fdatasync)."""
        self.write_page(self.encode(manifest), durable=durable)

    def write_page(self, page: bytes, *, durable: bool = False) -> None:
        """Write a page :func:`encode_state` made with :attr:`seq` (e.g. on a helper thread)."""
        if len(page) != STATE_BYTES:
            raise LimitError(f"{self.path}: a state page is {STATE_BYTES} bytes, not {len(page)}")
        self.open()
        pwrite_all(self._fd, page, self._slot * STATE_BYTES, str(self.path))
        self._seq += 1  # written (a failed barrier fences the session: nothing is written after it)
        self._slot = (self._slot + 1) % STATE_SLOTS
        if durable:
            self._sync(self._fd)

    @property
    def fd(self) -> int:
        """The state file's descriptor (opened now if it was not)."""
        self.open()
        return self._fd

    def sync(self) -> None:
        """The page's own barrier (the seam's fdatasync of the state file): after a
        :meth:`write_page` that was not ``durable``, unless one barrier covers several pages
        (:func:`sessionstore.sessions.committer.commit_together`)."""
        self._sync(self.fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _seq_of(page: bytes) -> int | None:
    """The ``seq`` of a page that passes its check (its payload unchecked), else None."""
    try:
        magic, version, length = _HEAD.unpack_from(page)
        (check,) = _CHECK.unpack_from(page, _HEAD.size + length)
        end = _HEAD.size + length
        if magic != STATE_MAGIC or length > MAX_PAYLOAD or check != xxhash.xxh3_64_intdigest(page[:end]):
            return None
        seq = json.loads(page[_HEAD.size:_HEAD.size + length]).get("seq", 0)
    except (struct.error, ValueError, AttributeError):
        return None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else None


def update_existing_state(manifest_path: str | os.PathLike[str], manifest: CommitFields) -> bytes | None:
    """Before a whole manifest is replaced: give an existing state file's slots the same values
    (numbered 0: a resident writer's next page, newer, wins over them), so no slot overrides the
    new manifest with older ones. Returns the file's bytes as they were, for
    :func:`put_back_state` should the replace fail (no file: nothing done, None)."""
    path = state_path(manifest_path)
    try:
        fd = _open_state(path, create=False)
    except FileNotFoundError:
        return None
    try:
        before = os.pread(fd, STATE_SLOTS * STATE_BYTES + 1, 0)
        slots = min(max(len(before) // STATE_BYTES, 1), STATE_SLOTS)  # those it has: no new block
        pwrite_all(fd, encode_state(manifest) * slots, 0, str(path))
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


__all__ = ["STATE_SUFFIX", "STATE_MAGIC", "STATE_BYTES", "STATE_SLOTS", "CommitFields", "state_path",
           "encode_state", "logits_json_of",
           "decode_state", "newest_state", "read_state_page", "StateWriter", "update_existing_state",
           "put_back_state"]
