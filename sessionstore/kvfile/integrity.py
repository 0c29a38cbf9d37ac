"""Rows are used only when the sidecar vouches for them (FORMAT.md 4.4, "Reading for use").

Every path that reads a session's rows to compute from them or to move them (resume, fork,
export, export-slot, convert of a session file) runs :func:`require_vouched` first:

- an absent sidecar vouches for nothing: the records are *not covered* (a file another writer,
  such as the engine, produced) and the caller says so; nothing is refused for that alone;
- a present sidecar must describe this header (static hash, record size) and be whole: it must
  vouch for at least ``required`` records (a session's manifest count), else it was rewound or
  cut short and the file is refused;
- every record it vouches for is hashed and compared; the first mismatch is a CorruptionError
  naming the file, the record and its byte offset. Records hashed in this process are hashed
  with the GIL released (:func:`~.sidecar.record_checksums`): the process's other threads (a
  server's loop, its other streams) go on meanwhile. In a process that runs a checksum helper
  (a server: :mod:`.hash_helper`), a large range's last half is hashed there meanwhile and
  compared the same way; whatever the helper cannot hash is hashed here. A pass that also
  gathers the scales (a v2/v3 resume) hashes every record here: the helper's share would have to
  be gathered afterwards from memory, cold, and the hash is bound by memory bandwidth on a small
  host (2 vCPUs, loaded: the 32k-token GLM-5.2-shaped check 249 / 210 ms with the helper,
  180 / 118 ms without, in process, alternated, medians of 7, two runs; a server's resume
  330-420 -> 200-220 ms).

A server's resume on a request may run the pass beside its turn's first step instead
(:func:`start_vouching`: a :class:`~.check_beside.PendingCheck` on a thread of its own, which hands
the hashing to the checksum helper process when one runs, FORMAT.md 4.4's last paragraph), only
when the sidecar vouches for exactly the committed records and no repair
would touch the files; its caller holds everything computed from the rows until the pass passed.

Nothing here writes: a refused file is left exactly as found.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from kernels.errors import ChecksumMismatchError, CorruptionError
from sessionstore.kvfile.check_beside import PendingCheck
from sessionstore.kvfile.hash_helper import HELPER_SHARE, MIN_SHARED_BYTES, active_hash_helper
from sessionstore.kvfile.header import HEADER_SIZE
from sessionstore.kvfile.reader import KVReader
from sessionstore.kvfile.sidecar import CHECK_CHUNK_RECORDS, Sidecar, hash_records, load_sidecar, static_hash
from sessionstore.log import get_logger

GATHER_BLOCK_RECORDS = 64  # records hashed, then their scales gathered (2.9 MB of GLM-5.2 records:
# still in cache for the gather; measured at 32k records: the two passes 205 ms, fused 167 ms)

log = get_logger("integrity")


@dataclass(frozen=True)
class Vouched:
    """What :func:`require_vouched` established about a file's committed records."""

    checked: int  # records [0, checked) match their checksums
    not_covered: int  # committed records past them that no sidecar of ours vouches for
    sidecar: bool  # a sidecar exists
    pending: PendingCheck[Vouched] | None = None  # the pass still running beside (start_vouching): until
    # its result() has returned, ``checked`` is only what the sidecar vouches for, not yet checked

    def describe(self) -> str:
        if self.pending is not None:
            return f"{self.checked} record(s) vouched for, their check running beside"
        if not self.sidecar:
            return (f"no sidecar: {self.not_covered} record(s) not covered by checksums (a file "
                    "another writer produced)")
        text = f"{self.checked} record(s) match their checksums"
        if self.not_covered:
            text += f"; {self.not_covered} past them not covered by the sidecar (another writer's)"
        return text


def require_vouched(reader: KVReader, required: int = 0, *,
                    vouched_by: str | os.PathLike[str] | None = None, gather_scales: bool = False) -> Vouched:
    """Check every committed record of ``reader`` that its sidecar vouches for (see module doc).

    ``required``: the sidecar must vouch for at least ``min(required, nrec)`` records (the
    records a session's manifest says it committed). ``vouched_by``: the kv path whose sidecar
    vouches (a copy checked against its source's sidecar); default ``reader.path``.
    ``gather_scales``: the pass also gathers the records' scales for the reader's rows
    (:meth:`KVReader.gather_scales`), each block while it is in cache (a resume reads them next).
    Raises CorruptionError; never writes.
    """
    n = reader.nrec
    sidecar, vouched = vouching_sidecar(reader, required, vouched_by=vouched_by)
    if sidecar is None:
        return Vouched(checked=0, not_covered=n, sidecar=False)
    # records [mine, vouched) hashed by the helper meanwhile; a gathering pass hashes them all here (module doc)
    _check_shared(reader, sidecar.entries, vouched, 0.0 if gather_scales else HELPER_SHARE, gather_scales)
    return Vouched(checked=vouched, not_covered=n - vouched, sidecar=True)


def vouching_sidecar(reader: KVReader, required: int = 0, *,
                     vouched_by: str | os.PathLike[str] | None = None) -> tuple[Sidecar | None, int]:
    """The sidecar that vouches for ``reader``'s records and how many it vouches for, its header
    and count checked (the cheap half of :func:`require_vouched`, no record hashed): (None, 0)
    when there is none. Raises CorruptionError (another header, fewer than ``required``)."""
    n = reader.nrec
    sidecar = load_sidecar(reader.path if vouched_by is None else vouched_by)  # damaged: raises
    if sidecar is None:
        return None, 0
    if sidecar.record_bytes != reader.record_bytes or sidecar.static_hash != static_hash(reader.header_bytes):
        raise CorruptionError(
            f"{reader.path}: its sidecar {sidecar.path} describes another header (record size "
            f"{sidecar.record_bytes}, this file's {reader.record_bytes}, or dims/vocab/tag changed); "
            "refusing to use its rows")
    vouched = min(sidecar.count, sidecar.available, n)
    need = min(max(int(required), 0), n)
    if vouched < need:
        raise CorruptionError(
            f"{reader.path}: its sidecar vouches for {vouched} record(s), {need} are committed "
            f"(count {sidecar.count}, {sidecar.available} entries on disk: rewound or cut short); "
            "refusing to use rows it cannot vouch for")
    return sidecar, vouched


def check_hashes(reader: KVReader, entries: np.ndarray, stop: int, vouched: int, *,
                 gather_scales: bool = False) -> None:
    """Hash records [0, stop) of ``reader`` here and compare them with the sidecar's ``entries``
    [>= stop] u64 (``vouched``: how many it vouches for, named in the error); ``gather_scales``
    as :func:`require_vouched`'s. The first mismatch raises ChecksumMismatchError."""
    for start in range(0, stop, CHECK_CHUNK_RECORDS):
        end = min(start + CHECK_CHUNK_RECORDS, stop)
        found = _hash_gathering(reader, start, end) if gather_scales else hash_records(reader, start, end)
        _compare(reader, entries, start, found, vouched)


def start_vouching(reader: KVReader, required: int = 0) -> PendingCheck[Vouched] | None:
    """:func:`require_vouched` of ``reader``, its hashing pass started on a thread of its own
    (:class:`~.check_beside.PendingCheck`; its ``result()`` is the :class:`Vouched`, or raises the
    CorruptionError the serial check would), when the sidecar vouches for exactly every committed
    record and the commit word counts them all (no repair would touch the files: FORMAT.md 3.5);
    None otherwise (the caller checks serially). The sidecar's header and count are checked here,
    at once. The caller owns the pass: it waits for it before ``reader`` is closed."""
    if reader.version == 1:
        return None
    n = reader.nrec
    sidecar, vouched = vouching_sidecar(reader, required)
    if sidecar is None or not n or vouched != n or sidecar.count != n or reader.header.nrec != n:
        log.info("kv.vouch_serial", path=reader.path, nrec=n, header_nrec=reader.header.nrec,
                 count=None if sidecar is None else sidecar.count, vouched=vouched)
        return None
    entries = sidecar.entries

    def run() -> Vouched:  # the whole pass to the helper process when one runs (see _check_shared)
        _check_shared(reader, entries, n, 1.0, gather_scales=False)
        return Vouched(checked=n, not_covered=0, sidecar=True)

    return PendingCheck(run, name="coli-vouch")


def _check_shared(reader: KVReader, entries: np.ndarray, vouched: int, share: float, gather_scales: bool) -> None:
    """Records [0, vouched) checked against ``entries``, the last ``share`` of a large range hashed by
    the checksum helper process meanwhile when one runs (:mod:`.hash_helper`; whatever it cannot give
    is hashed here), the rest here (:func:`check_hashes`, without the GIL). A pass beside a turn's
    first step gives the helper all of it (``share`` 1), leaving this process's cores to the step.
    (Before the hashing here let go of the GIL, that was also what kept the server's other threads
    going: xxhash keeps the GIL for a record-sized call, a probe's ``os.stat`` 2.4 us alone, ~790 us
    beside such a hasher.)"""
    helper = active_hash_helper()
    mine, theirs = vouched, None
    if helper is not None and share > 0 and vouched * reader.record_bytes >= MIN_SHARED_BYTES:
        mine = int(vouched * (1.0 - share))
        theirs = helper.submit(reader.path, reader.identity, HEADER_SIZE, reader.record_bytes, mine, vouched)
    check_hashes(reader, entries, mine, vouched, gather_scales=gather_scales)
    if theirs is not None:
        found = theirs()
        if found is None or found.shape[0] != vouched - mine:  # the helper failed: hash here
            found = hash_records(reader, mine, vouched)
        _compare(reader, entries, mine, found, vouched)


def _compare(reader: KVReader, entries: np.ndarray, start: int, found: np.ndarray, vouched: int) -> None:
    """Checksums ``found`` [k] of records [start, start + k) against the sidecar's; the first
    mismatch raises."""
    wrong = np.flatnonzero(found != entries[start:start + found.shape[0]])  # [m] offsets in the range
    if wrong.size:
        _raise_mismatch(reader, entries, start + int(wrong[0]), int(found[wrong[0]]), vouched)


def _hash_gathering(reader: KVReader, start: int, stop: int) -> np.ndarray:
    """:func:`hash_records` of [start, stop) in blocks of GATHER_BLOCK_RECORDS, each block's
    scales gathered right after it is hashed (one pass over the mapping instead of two): [k] u64."""
    out = np.empty(stop - start, dtype="<u8")  # [k] u64
    for b0 in range(start, stop, GATHER_BLOCK_RECORDS):
        b1 = min(b0 + GATHER_BLOCK_RECORDS, stop)
        out[b0 - start:b1 - start] = hash_records(reader, b0, b1)
        reader.gather_scales(b0, b1)
    return out


def token_problem(reader: KVReader) -> str | None:
    """Why the records' input tokens are unsound (an id outside [0, vocab)), or None."""
    tokens = reader.tokens  # [nrec] i32 (a strided view of the mapping)
    bad = np.flatnonzero((tokens < 0) | (tokens >= reader.dims.vocab))  # [b] positions
    if not bad.size:
        return None
    return bad_token_message(int(bad.size), int(bad[0]), int(tokens[bad[0]]), reader)


def bad_token_message(count: int, position: int, token: int, reader: KVReader) -> str:
    return (f"{count} token id(s) outside [0, {reader.dims.vocab}); first at record {position} "
            f"(byte {HEADER_SIZE + position * reader.record_bytes}): {token}")


def require_sound(reader: KVReader, required: int = 0) -> Vouched:
    """What `coli-kv verify` calls sound, required before rows are installed (import): every
    token id inside the vocabulary and :func:`require_vouched`. Raises CorruptionError."""
    problem = token_problem(reader)
    if problem is not None:
        raise CorruptionError(f"{reader.path}: unsound: {problem}")
    return require_vouched(reader, required)


def _raise_mismatch(reader: KVReader, entries: np.ndarray, first: int, found: int,
                    vouched: int) -> None:
    """The error for a condemned record: counts every other mismatch first (a failure path)."""
    rest = first + 1
    total = 1
    for start in range(rest, vouched, CHECK_CHUNK_RECORDS):
        stop = min(start + CHECK_CHUNK_RECORDS, vouched)
        total += int(np.count_nonzero(hash_records(reader, start, stop) != entries[start:stop]))
    rec = reader.record_bytes
    others = f"; {total} of {vouched} vouched records fail" if total > 1 else ""
    raise ChecksumMismatchError(
        f"{reader.path}: the record at position {first} (byte {HEADER_SIZE + first * rec}) fails "
        f"its checksum in the sidecar (hashes {found:#018x}, vouched {int(entries[first]):#018x})"
        f"{others}; refusing to use its rows (`coli-kv verify` reports the damage)", total)


class VouchedMapping:
    """The mapping an opening writer checked its vouched records through (FORMAT.md 4.4), kept
    so that the caller who resumes can reuse it (no second mapping, no second page faults)."""

    def __init__(self) -> None:
        self._vouched: Vouched | None = None
        self._reader: KVReader | None = None
        self._pending: PendingCheck[Vouched] | None = None  # the pass check(beside=True) started, done or not

    def check(self, reader: KVReader, required: int, *, beside: bool = False) -> None:
        """Check ``reader``'s vouched records (:func:`require_vouched`) and keep the mapping. With
        ``beside``, the pass runs on a thread when :func:`start_vouching` may start one (``vouched``
        is then provisional, :attr:`pending` the pass: its owner takes the result), and no scale is
        gathered (a caller that checks beside reads the scales in place); ``reader`` may then be
        mapped without populate: its tokens are gathered first (:meth:`KVReader.token_copy`), which
        maps every record's pages."""
        self._reader = reader
        if beside:  # mapped without populate: the tokens' gather maps the pages, before the pass starts
            reader.token_copy()  # (faults beside the pass's hashing were 10x slower: 140 ms at 32k)
        self._pending = pending = start_vouching(reader, required) if beside else None
        if pending is not None:
            self._vouched = Vouched(checked=reader.nrec, not_covered=0, sidecar=True, pending=pending)
            return
        self._vouched = require_vouched(reader, required, gather_scales=reader.version != 1)

    @property
    def vouched(self) -> Vouched | None:
        """What the check found (None before one): a pass that ran beside and passed gives its own
        :class:`Vouched` from then on; while it runs, or once it failed, the provisional one."""
        found = self._vouched
        if found is not None and found.pending is not None and found.pending.passed():
            self._vouched = found = found.pending.result()
        return found

    @property
    def pending(self) -> PendingCheck[Vouched] | None:
        """The pass :meth:`check` started beside (None when it ran serially), whether it is still
        running, has passed or has failed: :attr:`vouched` stops naming it once it has passed, but
        its owner still takes its result (and reports its time) through this."""
        return self._pending

    def take(self, nrec: int, version: int) -> KVReader | None:
        """The reader, handed to the caller (who then owns it) when it still describes the file
        (same commit word and version: no repair changed them); None otherwise."""
        reader, self._reader = self._reader, None
        if reader is not None and (reader.header.nrec, reader.version) != (nrec, version):
            reader.close(defer_unmap=True)
            return None
        return reader

    def drop(self) -> None:
        if self._pending is not None:
            self._pending.wait()  # never unmap under the pass
        if self._reader is not None:
            self._reader.close(defer_unmap=True)  # unmapping a big file: off the caller's path
            self._reader = None


__all__ = ["Vouched", "VouchedMapping", "bad_token_message", "check_hashes", "require_sound", "require_vouched",
           "start_vouching", "token_problem", "vouching_sidecar"]
