"""The checks of a resume and the recovery of a session's manifest (FORMAT.md 5.5).

A session resumes under its writer lock, with its committed rows mapped (``Session.ensure_resident``);
then :func:`check_resume` decides what is true and says so in the resume report:

- recovery: the file's committed count F is the truth. When the manifest's M differs (killed
  between the two commit steps, inside a truncate, or an OS crash that lost an unsynced
  manifest), the logits of position F-1 are recomputed (a single-token step), the pending
  token re-sampled at (seed, F) and the manifest rewritten durably (a ``recovery`` event);
- verification (before the first token is computed from the last position's logits): the
  recomputed last position's rows must equal the stored record and its logits the manifest's
  digest; anything else is a failed resume (``CorruptionError`` naming the session, its kv file
  and, when the sidecar finds them, the damaged records), never silently different text;
- deferral (``defer``): when a sidecar of ours vouched for every committed record and no
  recovery is due, that recompute checks nothing the checksums did not, so it waits until a
  turn samples from those logits (:func:`verify_last`); a turn that feeds tokens never does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kernels.errors import ChecksumMismatchError, ColiError, CorruptionError
from kernels.model.protocols import Decoder, LatentCache
from kernels.model.sampling import Sampler
from sessionstore.kvfile import HEADER_SIZE, KVReader, Vouched, check_records, load_sidecar
from sessionstore.log import get_logger
from sessionstore.sessions.conversation_file import read_record
from sessionstore.sessions.digest import make_digest
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest, write_manifest
from sessionstore.sessions.turn_loop import compare_rows, recompute_last

log = get_logger("session")

DEFERRED = ("checksums: every committed record matched; the last position is recomputed and checked "
            "only when a turn samples from its logits")


@dataclass(frozen=True)
class ResumeTarget:
    """A session just mapped under its writer lock: what its checks read and may repair."""

    session_id: str
    model: Decoder[Any]
    cache: LatentCache  # the decoder cache built over the committed rows
    reader: KVReader  # the mapping those rows are views of
    vouched: Vouched | None  # what the writer's open checked against the sidecar
    manifest: Manifest  # the session's own manifest: a recovery updates it in place
    directory: Path
    kv_path: Path
    manifest_fsync: bool = False


@dataclass
class ResumeCheck:
    """The resume report and the logits of the last committed position when they were
    recomputed (None otherwise: an empty session, or verification skipped)."""

    report: dict[str, Any]
    logits: np.ndarray | None = None  # [vocab] f32
    deferred: bool = False  # the last position is still to be checked (verify_last) before use


def check_resume(target: ResumeTarget, *, verify: bool = True, defer: bool = False) -> ResumeCheck:
    """Verify (``verify``) and recover; a manifest that disagrees with the file is recovered
    even when verification is off. ``defer``: when the sidecar vouched for every committed
    record and the manifest agrees with the file, the last position is not recomputed now
    (:func:`may_defer`); the caller runs :func:`verify_last` before it uses those logits."""
    consistent = target.cache.length == target.manifest.committed
    if verify and defer and may_defer(target):
        vouched = target.vouched
        assert vouched is not None  # may_defer: every record vouched for
        return ResumeCheck({"verified": DEFERRED, "recovered": False, "checksums": vouched.describe(),
                            "not_covered": 0, "last_position": "deferred"}, deferred=True)
    if verify or not consistent:  # recovery: always
        return verify_and_recover(target)
    vouched = target.vouched
    return ResumeCheck({"verified": "skipped", "recovered": False,
                        "checksums": vouched.describe() if vouched else None})


def may_defer(target: ResumeTarget) -> bool:
    """True when the recompute of the last position adds nothing to what the open checked: a
    sidecar of ours vouched for every committed record (checksums matched) and the manifest's
    count is the file's (no recovery to do). Records no sidecar covers always take the recompute."""
    vouched, n = target.vouched, target.cache.length
    return (n > 0 and n == target.manifest.committed and vouched is not None and vouched.sidecar
            and vouched.not_covered == 0 and vouched.checked >= n)


def verify_and_recover(target: ResumeTarget) -> ResumeCheck:
    """Recompute the last committed position, check it against the stored record and the
    manifest's digest, and recover the manifest when its count differs from the file's."""
    manifest = target.manifest
    n, m = target.cache.length, manifest.committed
    report: dict[str, Any] = {"verified": "empty", "recovered": False}
    vouched = target.vouched
    if vouched is not None:
        report["checksums"] = vouched.describe()
        report["not_covered"] = vouched.not_covered
    if n == 0:
        if m != 0:
            recover_manifest(target, n, m, None)
            report["recovered"] = True
        return ResumeCheck(report)
    logits, found = verify_last(target, digest_ok=n == m)
    report.update(found)
    if vouched is not None and vouched.not_covered:  # the tolerance path, said out loud
        report["verified"] += (f"; {vouched.not_covered} record(s) not covered by a sidecar of "
                               "ours: checked only through the recomputed last position")
        log.warning("session.resume_not_covered", id=target.session_id, not_covered=vouched.not_covered)
    if n != m:
        recover_manifest(target, n, m, logits)
        report["recovered"] = True
    return ResumeCheck(report, logits)


def verify_last(target: ResumeTarget, *, digest_ok: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
    """Recompute the last committed position as a single-token step; its rows must equal the
    stored record and (``digest_ok`` and a digest of that position) its logits the manifest's
    digest. Writes the digest when the manifest has none for it. Returns (logits [vocab] f32,
    the report's fields); raises CorruptionError naming the session and its kv file."""
    manifest, cache = target.manifest, target.cache
    n = cache.length
    found: dict[str, Any] = {"last_position": "recomputed"}
    logits, rows = recompute_last(target.model, cache.blocks, cache.tokens, manifest.kv_dtype, cache.index_rows())
    try:
        found["rows_exact"] = compare_rows(rows, target.reader, n - 1)
    except CorruptionError as exc:
        raise explain_mismatch(target, n, exc) from None
    digest = manifest.last_logits
    if digest_ok and digest is not None and digest.position == n - 1:
        try:
            exact, detail = digest.check(logits)  # raises CorruptionError on a real mismatch
        except CorruptionError as exc:
            raise explain_mismatch(target, n, exc) from None
        found["verified"] = "bit-identical" if exact else "within tolerance"
        found["detail"] = detail
        if not exact:
            log.warning("session.resume_inexact", id=target.session_id, detail=detail)
    else:
        found["verified"] = "recomputed (no digest to compare)"
        if digest_ok:  # n == the manifest's count: its digest is the one to (re)write
            manifest.last_logits = make_digest(logits, n - 1)
            write_manifest(target.directory / MANIFEST_NAME, manifest, durable=target.manifest_fsync)
    return logits, found


def explain_mismatch(target: ResumeTarget, n: int, exc: CorruptionError) -> CorruptionError:
    """The resume error for a digest mismatch, naming the session and its kv file; the full
    sidecar check runs only here (after the mismatch), never on a sound resume."""
    cause = ""
    reader = target.reader
    report = None
    try:
        sidecar = load_sidecar(target.kv_path)
        report = check_records(reader, sidecar) if sidecar is not None else None
    except ColiError as err:
        cause = f"; the sidecar cannot vouch for the records ({err})"
    else:
        if report is not None and report.status == "corrupt" and report.mismatched_positions:
            rec = reader.record_bytes
            where = ", ".join(f"{p} (byte {HEADER_SIZE + p * rec})"
                              for p in report.mismatched_positions[:8])
            if report.mismatched == 1:
                cause = f"; the record at position {where} fails its checksum in the sidecar"
            else:
                more = " ..." if report.mismatched > 8 else ""
                cause = (f"; {report.mismatched} records fail their checksums in the sidecar, "
                         f"at positions {where}{more}")
        elif report is not None and report.status == "corrupt":
            cause = "; " + "; ".join(report.messages)
    message = (f"session {target.session_id!r}: resume of {target.kv_path} failed verification ({n} committed "
               f"records): {exc}{cause}")
    if report is not None and report.mismatched:  # the sidecar's checksums refuse these records
        return ChecksumMismatchError(message, report.mismatched)
    return CorruptionError(message)


def pending_token(target: ResumeTarget, n: int, logits: np.ndarray) -> int:
    """The token pending at position ``n``, drawn from ``logits`` [V] again by what drew it: the
    chat turn's own settings when the session's conversation file records them (FORMAT.md 5.8; an
    API turn never writes the manifest's): the open turn's once its prompt is in, or the last closed
    turn's when the file's history is these ``n`` tokens and the token its settings draw (its digest
    checks that); not settings that process the logits (penalties, bias, a grammar: their state is
    not rebuilt here). Otherwise the manifest's settings draw it."""
    record = read_record(target.directory)
    turn = None if record is None else record.turn
    if turn is not None and n >= turn.prompt_tokens and _plain(turn.sampler, turn.response_format):
        assert turn.sampler is not None  # _plain
        return turn.sampler(logits, n)
    if record is not None and turn is None and record.tokens == n + 1 and _plain(record.sampler,
                                                                                record.response_format):
        assert record.sampler is not None  # _plain
        token = record.sampler(logits, n)
        if record.agrees_with([*target.cache.tokens[:n].tolist(), token]):
            return token
    return target.manifest.sampler(logits, n)


def _plain(sampler: Sampler | None, response_format: object) -> bool:
    """Recorded settings that draw from the logits as given (no processing, no grammar)."""
    return sampler is not None and not sampler.processing and response_format is None


def rest_of_tail(target: ResumeTarget, n: int, m: int) -> list[int]:
    """A file ahead of its page (``n`` records, the page's ``m``: a kv commit's commit word
    landed, its page not): the page's tail (a durable stream's pending tokens, FORMAT.md 5.5)
    that the file's extra records do not cover. Those records must be the tail's first tokens;
    when they differ the file's records win as the committed prefix (said in the log) and
    nothing of the tail is kept. Empty when the records cover the whole tail."""
    tail = list(target.manifest.pending)
    if n <= m or not tail:
        return []
    extra = [int(t) for t in target.cache.tokens[m:n]]
    k = min(len(extra), len(tail))
    if extra[:k] != tail[:k]:
        log.warning("session.tail_differs", id=target.session_id, file_committed=n, page_committed=m,
                    tail=tail, records=extra, kept="the file's records, a committed prefix")
        return []
    return tail[len(extra):]


def recover_manifest(target: ResumeTarget, n: int, m: int, logits: np.ndarray | None) -> None:
    """The file's commit word is the truth: rebuild the manifest's dynamic fields at ``n``: the
    digest of position n-1, and as pending the rest of the page's tail past the file's records
    (:func:`rest_of_tail`), or, when nothing of it is left, the pending token drawn again at
    (seed, n) from ``logits`` by :func:`pending_token`."""
    manifest = target.manifest
    old_pending = list(manifest.pending)
    pending: list[int] = []
    if logits is not None:
        pending = rest_of_tail(target, n, m) or [pending_token(target, n, logits)]
        manifest.last_logits = make_digest(logits, n - 1)
    else:
        manifest.last_logits = None
    manifest.committed = n
    manifest.pending = list(pending)
    write_manifest(target.directory / MANIFEST_NAME, manifest)
    log.warning("session.recovery", id=target.session_id, file_committed=n, manifest_committed=m,
                pending_was=old_pending, pending=pending)


__all__ = ["DEFERRED", "ResumeTarget", "ResumeCheck", "check_resume", "may_defer", "verify_and_recover",
           "verify_last", "explain_mismatch", "pending_token", "rest_of_tail", "recover_manifest"]
