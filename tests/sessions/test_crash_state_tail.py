"""Every crash state a POSIX file system may leave during a durable stream's commits, checked
(FORMAT.md 3.9 and 5.5; issue 26 part 2): a decode loop whose every token is committed before
its text would go out, by tail commits (the state page alone, ``pending`` = every token after the
kv file's records) between kv commits (every ``commit_every`` tokens), then a suspend.

Built as ``tests/sessions/test_crash_states.py`` (record, build the states, sample with seed 26).
A commit's return is marked with the number of tokens it covers (the history the client may have
been shown). Every state is read the way any reader reads a session (manifest, state page, kv
file): its history (records + pending) must be a prefix of the uninterrupted run's that holds
every token a returned commit covered. One state in ``OPEN_EVERY`` is also opened with the tiny
model (kv recovery, manifest recovery: a file ahead of its page keeps the rest of the tail) and
continued by ``CONTINUE`` tokens, which must be the uninterrupted run's. Run with
``pytest -k crash_state``.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest

from kernels.model.sampling import Sampler
from sessionstore.kvfile.reader import open_kv
from sessionstore.sessions import committer as committer_module
from sessionstore.sessions.committer import BarrierCommit, commit_together
from sessionstore.sessions.session_options import SessionOptions
from sessionstore.sessions.store import SessionStore
from tests.support.crash_explore import Exploration, explore, record
from tests.support.crash_trace import Op, Recorder

PROMPT = list(b"Once upon a time")
SAMPLER = Sampler(0.9, 50, 0.95, 4242)
COMMIT_EVERY = 40  # tails up to 40 tokens: pages past one 512-byte sector, so a crash can tear them
FIRST, DECODE, CONTINUE = 2, 48, 3  # tokens of the setup's turn, of the recorded one, after a reopen
BUDGET = 40  # distinct states per crash point and sector size
OPEN_EVERY = 25  # one state in this many is also opened with the model and continued
OPTIONS = SessionOptions(commit_every=COMMIT_EVERY, durable_stream=True)


class Covered:
    """A session's commit watch that marks, once each commit returned, the tokens it covers."""

    def __init__(self, session: Any, rec: Recorder) -> None:
        self.session, self.rec = session, rec

    def mark(self) -> int:
        return int(self.session.cache.length) + len(self.session.pending)

    def committed(self, mark: int) -> None:
        self.rec.mark("shown", mark)


def _shown(ops: list[Op], k: int) -> int:
    """The most tokens a commit that returned among the first ``k`` ops covered."""
    return max([op.value for op in ops[:k] if op.kind == "mark" and op.label == "shown"], default=0)


class TailCheck:
    def __init__(self, tiny: Any, stream: list[int]) -> None:
        self.tiny, self.stream = tiny, stream
        self.checked = self.opened = 0

    def __call__(self, root: str, shown: int) -> None:
        store = SessionStore(root)
        manifest = store.read_manifest("d")
        with open_kv(os.path.join(root, "sessions", "d", "kv.coli_kv")) as reader:
            assert manifest.committed <= reader.nrec, f"the page counts {manifest.committed}, the file {reader.nrec}"
            history = [int(t) for t in reader.tokens[:manifest.committed]] + list(manifest.pending)
        assert history == self.stream[:len(history)], "the history on disk is not a prefix of the run"
        assert len(history) >= shown, f"{len(history)} tokens on disk, {shown} were covered by returned commits"
        self.checked += 1
        if (self.checked - 1) % OPEN_EVERY:
            return
        self.opened += 1
        store.adopt_model("tiny", self.tiny)
        s = store.open("d", "tiny", options=OPTIONS)
        try:
            tokens = s.history()
            assert len(tokens) >= shown, f"reopened with {len(tokens)} tokens, {shown} were shown"
            assert tokens == self.stream[:len(tokens)], "the reopened history is not a prefix of the run"
            more = s.generate(None, CONTINUE).tokens
            assert tokens + more == self.stream[:len(tokens) + CONTINUE], "the continuation differs"
        finally:
            s.close()


def _setup(tiny: Any):
    def setup(root: str) -> None:
        store = SessionStore(root)
        store.adopt_model("tiny", tiny)
        s = store.create("d", "tiny", kv_dtype="fp8", sampler=SAMPLER, options=OPTIONS)
        s.generate(PROMPT, FIRST)
        s.close()
    return setup


def _durable_decode(tiny: Any):
    def protocol(root: str, rec: Recorder) -> None:
        store = SessionStore(root)
        store.adopt_model("tiny", tiny)
        s = store.open("d", "tiny", options=OPTIONS)
        s.commit_watch = Covered(s, rec)
        s.generate(None, DECODE)  # a tail commit per token, a kv commit every COMMIT_EVERY records
        s.commit_watch = None
        s.suspend()
    return protocol


def test_crash_state_durable_stream_tail(tmp_path, tiny) -> None:
    from sessionstore.sessions.turn_loop import reference_turns

    stream = PROMPT + reference_turns(tiny, "fp8", [(PROMPT, FIRST + DECODE + CONTINUE + 2)], SAMPLER)[0]
    rec = record(str(tmp_path / "root"), _setup(tiny), _durable_decode(tiny))
    tails = sum(1 for op in rec.ops if op.kind == "write" and op.offset % 4096 == 0 and len(op.data) == 4096)
    check = TailCheck(tiny, stream)
    result: Exploration = explore("durable stream: tail and kv commits", rec, check, budget=BUDGET,
                                  acked=_shown, strict_rename=True)
    print(result.summary())
    print(f"  page writes {tails}, opened with the model and continued: {check.opened}")
    assert not result.failures, result.summary() + "\n" + "\n".join(result.failures)
    assert check.opened > 0 and _shown(rec.ops, len(rec.ops)) >= len(PROMPT) + FIRST + DECODE


def _shared_barrier_decode(tiny: Any):
    """The same decode with every tail commit run as a server's group runs it (:func:`commit_together`:
    the page written, ONE ``syncfs``, then settled), the syncfs recorded as the barrier of every
    file and directory under the root."""
    def protocol(root: str, rec: Recorder) -> None:
        real = committer_module.syncfs

        def runner(commit: Any, *, overlap: bool = False) -> None:
            if isinstance(commit, BarrierCommit) and commit.share is not None:
                errors = commit_together([commit])
                if errors[0] is not None:
                    raise errors[0]
            else:
                commit()

        store = SessionStore(root)
        store.adopt_model("tiny", tiny)
        s = store.open("d", "tiny", options=replace(OPTIONS, commit_runner=runner))
        s.commit_watch = Covered(s, rec)
        committer_module.syncfs = lambda fd: rec.sync_filesystem(lambda: real(fd))
        try:
            s.generate(None, DECODE)
        finally:
            committer_module.syncfs = real
        s.commit_watch = None
        s.suspend()
    return protocol


def test_crash_state_durable_stream_tail_shared_barrier(tmp_path, tiny) -> None:
    """Crash states of tail commits made durable by the shared barrier (issue 39): every state's
    history holds every token a returned commit covered, as with a barrier per page."""
    from sessionstore.sessions.turn_loop import reference_turns

    if not committer_module.syncfs_available():
        pytest.skip("no syncfs(2) on this system: tail commits are never shared")
    stream = PROMPT + reference_turns(tiny, "fp8", [(PROMPT, FIRST + DECODE + CONTINUE + 2)], SAMPLER)[0]
    rec = record(str(tmp_path / "root"), _setup(tiny), _shared_barrier_decode(tiny))
    shared = sum(1 for op in rec.ops if op.kind == "dsync")
    check = TailCheck(tiny, stream)
    result: Exploration = explore("durable stream: tail commits under a shared barrier", rec, check,
                                  budget=BUDGET, acked=_shown, strict_rename=True)
    print(result.summary())
    print(f"  directory barriers (from the syncfs) {shared}, opened with the model and continued: {check.opened}")
    assert not result.failures, result.summary() + "\n" + "\n".join(result.failures)
    assert shared > 0, "no tail commit went through the shared barrier"
    assert check.opened > 0 and _shown(rec.ops, len(rec.ops)) >= len(PROMPT) + FIRST + DECODE
