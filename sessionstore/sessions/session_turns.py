"""A session's turns, functions over a resident session (:class:`~sessionstore.sessions.session_resume.Resuming`;
:class:`~sessionstore.sessions.session.Session`'s ``generate`` / ``append_tokens`` / ``truncate`` call them):
:func:`generate` (prefix reuse, feeding, the decode loop of :mod:`sessionstore.sessions.turn_loop`,
commits every ``commit_every`` tokens), prompt ingestion without sampling (:func:`append_tokens`) and
:func:`truncate`.

Token ids are checked once, where they enter: :func:`check_turn` and :func:`check_ids` are the Session
API's check (``Session.generate`` and ``Session.append_tokens`` run them for a library's caller); the
server checks a request's ids in its core (``TurnRunner.admit``) and the CLI where it reads them, and
both then reach :func:`generate` through :func:`~sessionstore.sessions.turn.run_turn`. The functions
here trust their callers: they check no id against the vocabulary and no turn against the context.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from kernels.errors import FormatError, LimitError
from kernels.model.logits import TurnDraw, settings_of
from kernels.model.sampling import Sampler
from sessionstore.log import get_logger
from sessionstore.sessions.manifest import MANIFEST_NAME, write_manifest
from sessionstore.sessions.output import TurnReply
from sessionstore.sessions.session_resume import (
    Resuming,
    await_check,
    await_files,
    ensure_resident,
    last_logits,
    release,
    run_io,
)
from sessionstore.sessions.turn_loop import common_prefix, decode_turn, feed_chunk

APPEND_RUN = 16  # decoded records are handed to the writer 16 at a time (and at every commit): one
# hand-over per token cost ~0.7 ms of per-token work that a batched decode step cannot share; runs of 8
# against 16 (a serve's --commit-every: one hand-over a commit), one durable-stream session in process,
# 15 alternated reps: 1,019 against 981 us of CPU a token (BENCHMARKS.md session 30)
IO_ROWS = 64  # a hand-over of at least this many rows (a prompt's) runs by the session's io_runner

log = get_logger("session")


def check_ids(session: Resuming, ids: Sequence[int]) -> np.ndarray:
    """``ids`` as [m] i32, refused (one clear error) if one is outside the model's vocabulary: the
    Session API's check of the ids a library's caller gives."""
    checked: np.ndarray = session.model.check_tokens(np.asarray(ids, dtype=np.int64))  # [m] i32
    return checked


def check_turn(session: Resuming, prompt_ids: Sequence[int] | None, max_new: int) -> None:
    """The Session API's check of a turn, before any work: ``prompt_ids`` against the vocabulary and
    the turn (the prompt, or the history and its pending token, and ``max_new`` - 1 fed tokens: the
    last drawn is never fed) against the model's context."""
    s = session
    context = int(s.model.config.max_position_embeddings)
    new = max(max_new - 1, 0) if isinstance(max_new, int) else 0  # a bad max_new: generate refuses it
    if prompt_ids is not None:
        end = check_ids(s, prompt_ids).shape[0] + new  # a prompt: its common prefix kept, its rest fed
    else:
        ensure_resident(s)
        end = s.files.live_cache.length + len(s.pending) + new
    if end > context:
        raise LimitError(f"{end} positions exceed the model's context of {context}")


def generate(session: Resuming, prompt_ids: Sequence[int] | None = None, max_new: int = 16, *,
             stop_at_eos: bool = False, sampler: Sampler | TurnDraw | None = None, keep_sampler: bool = True,
             on_token: Callable[[int, int], None] | None = None) -> TurnReply:
    """One turn. With ``prompt_ids`` the longest common prefix of the history is reused (the
    rest truncated) and the remainder fed; without, generation continues where it stopped.
    Returns its :class:`TurnReply` (its ``end``: EOS at an eos id with ``stop_at_eos``, else LENGTH;
    no text). Trusts its caller: the ids and the turn's room were checked where they entered
    (:func:`check_turn` for the Session API).
    ``sampler``: this turn's settings (None: the manifest's), or a :class:`TurnDraw` over them;
    with ``keep_sampler`` the settings are stored in the manifest for the turns after it,
    without they serve this turn only."""
    t0 = time.perf_counter()
    s, files = session, session.files
    ensure_resident(s, keep_check=True)  # a pass beside (a request's resume) is awaited after the first forward
    try:
        return _generate(s, t0, prompt_ids, max_new, stop_at_eos, sampler, keep_sampler, on_token)
    except BaseException:
        if files.check is not None:  # failed before the pass was awaited: nothing left; drop what ran on
            release(s)  # the unchecked rows (the writer's close waits for the pass)
        raise


def _generate(s: Resuming, t0: float, prompt_ids: Sequence[int] | None, max_new: int, stop_at_eos: bool,
              sampler: Sampler | TurnDraw | None, keep_sampler: bool,
              on_token: Callable[[int, int], None] | None) -> TurnReply:
    """:func:`generate`'s turn. A checksum pass running beside (``files.check``) is awaited before
    anything but a forward: before the manifest is rewritten, before a truncation, before the last
    position is recomputed, and after the first forward, before its rows are handed to the writer
    and before a token is drawn from its logits (:func:`await_check`; its failure raises)."""
    files, commits = s.files, s.commits
    s.residency.touch(s)
    if sampler is not None and keep_sampler and settings_of(sampler) != s.manifest.sampler:
        await_check(s)
        await_files(s)  # the manifest on disk is rewritten: a new session's must be there
        changed = dataclasses.replace(s.manifest, sampler=settings_of(sampler))
        write_manifest(s.directory / MANIFEST_NAME, changed)  # durable: rare; a failed one changes nothing
        s.manifest = changed
    turn_sampler = s.manifest.sampler if sampler is None else sampler
    reused = 0
    feed: list[int] | None
    if prompt_ids is not None:
        prompt = np.asarray(prompt_ids, dtype=np.int64)  # [m] i64, no Python list
        if not prompt.size:
            raise FormatError("the prompt is empty")
        k = common_prefix(files.live_cache.tokens, prompt)
        if k < files.live_cache.length:
            truncate(s, k)  # awaits a pass beside first (ensure_resident)
        reused = k
        feed = [int(t) for t in prompt[k:]]
    else:
        feed = list(s.pending) if s.pending else None
        if feed is None:  # nothing fed: the turn draws from the last position's logits at once
            await_check(s)
            if commits.committer.logits is None and files.live_cache.length:
                commits.note_logits(last_logits(s))
    commits_before = commits.committer.commits
    options = s.options  # read in place, once per turn

    def on_step(token: int, position: int, logits: np.ndarray) -> None:
        s.pending = [token]
        commits.note_logits(logits)
        if on_token is not None:
            on_token(token, position)
        every = options.commit_every
        due = bool(every) and files.live_cache.length - files.nrec >= (every or 0)
        # the commits inside the turn leave the catalogue's row to its last (FORMAT.md 5.9)
        if options.durable_stream:  # every token (its text is held until then), unless one is in flight:
            if not commits.in_flight:  # the next one covers this token too; a kv commit when due,
                commits.run(tail=not due, catalogue=False)  # else a tail commit (the page alone)
        elif due and files.ready():  # a new session's files still being made: the commit
            commits.run(catalogue=False)  # waits a token (a server's loop must not wait for them)

    def on_rows() -> None:  # after each forward: the first one's rows may be the pass's to vouch for
        await_check(s)
        _append_in_runs(s)

    turn = decode_turn(s.model, files.live_cache, feed, commits.committer.logits, max_new, turn_sampler,
                       stop_at_eos=stop_at_eos, on_rows=on_rows, on_step=on_step, drive=options.decode_driver)
    if not turn.tokens:
        s.pending = []
    commits.note_logits(turn.logits)
    assert not commits.in_flight  # a turn is woken only once its commits returned
    commits.run()
    reply = TurnReply(turn.tokens, end=turn.end, prompt_tokens=len(prompt_ids) if prompt_ids is not None else 0,
                      reused_prefix=reused, committed=files.live_writer.nrec, fed=len(feed) if feed else 0,
                      commits=commits.committer.commits - commits_before, seconds=time.perf_counter() - t0)
    s.residency.touch(s)
    return reply


def _append_in_runs(s: Resuming) -> None:
    """After a forward: hand the new rows to the writer once APPEND_RUN of them wait (a prefill
    at once; decode steps in runs, and every commit hands over the rest first). Rows not yet
    handed over are only uncommitted ones, which a crash loses either way."""
    if s.commits.in_flight or not s.files.ready():  # a commit is writing from the writer, or a new
        return  # session's files are being made: the rows wait for the next hand-over (or commit)
    if s.files.live_cache.length - s.files.live_writer.length >= APPEND_RUN:
        _hand_over_rows(s)


def _hand_over_rows(s: Resuming) -> None:
    """The cache's rows past the writer's length, handed to it: a prompt's many rows (at least
    ``IO_ROWS``: their packing, writes and checksums) by :func:`run_io`, on a server's I/O thread
    while its loop steps the other sessions (nothing else touches this session's cache or writer
    meanwhile); a decode run's few here. None while a new session's files are being made."""
    if not s.files.ready():
        return
    if s.files.live_cache.length - s.files.live_writer.length >= IO_ROWS:
        run_io(s, s.files.append_rows)
    else:
        s.files.append_rows()


def append_tokens(session: Resuming, tokens: Sequence[int], *, commit: bool | None = None) -> np.ndarray:
    """Feed ``tokens`` as records without sampling (prompt ingestion); returns the last logits.

    The pending token is dropped (these tokens replace it). ``commit``: True commits now,
    False never, None follows the commit policy. Trusts its caller: ``tokens`` were checked against
    the vocabulary where they entered (:func:`check_ids` for the Session API).
    """
    s = session
    ensure_resident(s)
    toks = [int(t) for t in tokens]
    logits = feed_chunk(s.model, s.files.live_cache, toks, lambda: _hand_over_rows(s))
    s.pending = []
    s.commits.note_logits(logits)
    await_files(s)
    writer, every = s.files.live_writer, s.options.commit_every
    due = bool(every) and writer.length - writer.nrec >= (every or 0)
    if commit or (commit is None and due):
        run_io(s, s.commits.begin())  # the kv commit's writes and fsyncs by run_io (Session.commit)
    return logits


def truncate(session: Resuming, n: int) -> int:
    """Keep the first ``n`` records (prefix reuse). The manifest's epoch is bumped FIRST.

    The file work (the commit of what came before, the manifest's rewrite, the kv file's cut: up
    to four fsyncs) runs by :func:`run_io`, on a server's I/O thread while its loop steps the other
    sessions (a new turn whose prompt parts from the history's tail truncates: on the loop's own
    thread these fsyncs held every running stream); the decoder cache is cut here once it has
    returned, in the same order as before."""
    s = session
    ensure_resident(s)
    n = max(0, min(int(n), s.files.live_cache.length))
    finish = s.commits.begin()  # fixed here (rows handed over); the manifest must never claim records
    # the file has not committed, so its rest runs first in the file work

    def cut_files() -> None:
        finish()
        cut = dataclasses.replace(s.manifest, epoch=s.manifest.epoch + 1, committed=n, pending=[], last_logits=None)
        # a write that fails (ENOSPC: no room for the temp file) changes nothing, here or on disk
        write_manifest(s.directory / MANIFEST_NAME, cut, durable=s.options.manifest_fsync)
        s.manifest, s.pending = cut, []
        s.commits.note_logits(None)
        s.commits.deferred = False  # the position changes: no digest describes the new last one
        s.files.live_writer.truncate(n)

    run_io(s, cut_files)
    s.files.live_cache.truncate(n)
    s.store.note_session(s.manifest, resident=True)
    log.info("session.truncate", id=s.id, committed=n, epoch=s.manifest.epoch)
    return n


__all__ = ["APPEND_RUN", "IO_ROWS", "append_tokens", "check_ids", "check_turn", "generate", "truncate"]
