"""A durable stream's tail commits (FORMAT.md 5.5; issue 26 part 2): between kv commits each
token's commit is the state page alone (one barrier), its ``pending`` every token after the
committed records; a reopen continues from that tail exactly; a file ahead of its page keeps the
rest of the tail, or wins when its records differ; a failed tail barrier fences the session and
its reopen puts back the last tail that returned."""
from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from typing import Any

import pytest

from kernels.model.sampling import Sampler
from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.reader import open_kv
from sessionstore.sessions import committer as committer_module
from sessionstore.sessions.commit_state_page import StateWriter
from sessionstore.sessions.committer import BarrierCommit, commit_together
from sessionstore.sessions.fence import FENCE_NAME, SessionFencedError
from sessionstore.sessions.manifest import MANIFEST_NAME
from sessionstore.sessions.session_options import SessionOptions
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import reference_turns

PROMPT = list(b"Once upon a time")
SAMPLER = Sampler(0.9, 50, 0.95, 4242)
DURABLE = SessionOptions(commit_every=64, durable_stream=True)  # kv commits every 64; tail commits between


class Barriers(Durability):
    """Counts the barriers per file name; ``fail_state_at``: the Nth barrier of the state page fails."""

    def __init__(self, fail_state_at: int = 0) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.fail_state_at = fail_state_at

    def fsync(self, fd: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        self.calls.append(name)
        if self.fail_state_at and name.endswith(".state") and self.calls.count(name) == self.fail_state_at:
            raise OSError(errno.EIO, "injected")
        super().fsync(fd)


class Watch:
    """Records, as each commit returns, the manifest any reader sees and the file's count."""

    def __init__(self, store: SessionStore, sid: str) -> None:
        self.store, self.sid, self.seen = store, sid, []

    def mark(self) -> int:
        return 0

    def committed(self, mark: int) -> None:
        m = self.store.read_manifest(self.sid)
        with open_kv(self.store.kv_path(self.sid)) as reader:
            self.seen.append((m.committed, list(m.pending), reader.nrec))


def _stream(tiny: Any, n: int) -> list[int]:
    return PROMPT + reference_turns(tiny, "fp8", [(PROMPT, n)], SAMPLER)[0]


def test_tail_commits_write_one_page_and_a_reopen_continues_exactly(tmp_path, tiny) -> None:
    stream = _stream(tiny, 16)
    store = SessionStore(tmp_path)
    store.adopt_model("tiny", tiny)
    s = store.create("d", "tiny", kv_dtype="fp8", sampler=SAMPLER, options=DURABLE)
    s.generate(PROMPT, 1)  # the prompt's kv commit
    io = Barriers()
    s.close()
    s = store.open("d", "tiny", options=replace(DURABLE, durability=io))
    watch = Watch(store, "d")
    s.commit_watch = watch
    tokens = s.generate(None, 8).tokens
    n = len(PROMPT)  # the records of the first turn's commit
    mid = watch.seen[:-1]  # every commit but the turn's last (a kv commit)
    assert len(mid) == 8 and all(committed == nrec == n for committed, _, nrec in mid)
    assert [len(p) for _, p, _ in mid] == list(range(2, 10))  # the tail grows by one token a commit
    assert all(PROMPT + p == stream[:n + len(p)] for _, p, _ in mid)
    assert io.calls[:8] == ["manifest.json.state"] * 8  # one barrier per tail commit, no kv barrier
    assert watch.seen[-1] == (n + 8, [stream[n + 8]], n + 8)  # the turn's end: a kv commit
    assert tokens == stream[n + 1:n + 9]
    s.close()  # a reopen from a tail alone: test_crash_state_durable_stream_tail, and the fence below
    again = store.open("d", "tiny", options=DURABLE)
    assert again.generate(None, 4).tokens == stream[n + 9:n + 13]
    again.close()


def test_a_tail_past_max_pending_is_a_kv_commit(tmp_path, tiny, monkeypatch) -> None:
    from sessionstore.sessions import session_commits

    monkeypatch.setattr(session_commits, "MAX_PENDING", 3)
    store = SessionStore(tmp_path)
    store.adopt_model("tiny", tiny)
    s = store.create("d", "tiny", kv_dtype="fp8", sampler=SAMPLER, options=DURABLE)
    watch = Watch(store, "d")
    s.commit_watch = watch
    s.generate(PROMPT, 8)
    assert all(len(p) <= 3 for _, p, _ in watch.seen)
    assert all(committed == nrec for committed, _, nrec in watch.seen)
    s.close()


@pytest.mark.parametrize("agree", [True, False])
def test_a_file_ahead_of_its_page_keeps_the_rest_of_the_tail(tmp_path, tiny, agree: bool) -> None:
    """A kv commit's word durable, its page not: the page's tail past the file's records stays
    pending; a tail that differs from the records is dropped, the file's records win."""
    stream = _stream(tiny, 12)
    store = SessionStore(tmp_path)
    store.adopt_model("tiny", tiny)
    s = store.create("d", "tiny", kv_dtype="fp8", sampler=SAMPLER, options=DURABLE)
    s.generate(PROMPT, 6)
    s.close()  # the file holds the prompt and 5 tokens; 1 pending
    n = len(PROMPT) + 5
    m = store.read_manifest("d")
    tail = stream[n - 3:n + 3] if agree else [1, 2, 3] + stream[n:n + 3]
    old = m.__class__(**{**m.__dict__, "committed": n - 3, "pending": tail, "last_logits": None})
    page = StateWriter(store.session_dir("d") / MANIFEST_NAME)
    page.write(old, durable=True)  # the page of an older commit, numbered newer: what a crash leaves
    page.close()
    assert store.read_manifest("d").committed == n - 3
    s = store.open("d", "tiny")
    assert s.committed == n and s.resume_report["recovered"]
    history = s.history()
    assert history == (stream[:n + 3] if agree else stream[:n + 1])
    assert s.generate(None, 2).tokens == stream[len(history):len(history) + 2]
    s.close()


def test_a_failed_tail_barrier_fences_and_the_reopen_keeps_the_last_tail_that_returned(tmp_path, tiny) -> None:
    stream = _stream(tiny, 12)
    store = SessionStore(tmp_path)
    store.adopt_model("tiny", tiny)
    s = store.create("d", "tiny", kv_dtype="fp8", sampler=SAMPLER, options=DURABLE)
    s.generate(PROMPT, 1)
    s.close()
    io = Barriers(fail_state_at=4)
    s = store.open("d", "tiny", options=replace(DURABLE, durability=io))
    watch = Watch(store, "d")
    s.commit_watch = watch
    with pytest.raises(SessionFencedError):
        s.generate(None, 8)
    assert len(watch.seen) == 3  # the 4th commit's barrier failed: it released nothing
    assert io.calls == ["manifest.json.state"] * 4  # never retried, nothing synced after it
    fence = json.loads((store.session_dir("d") / FENCE_NAME).read_text())
    last = watch.seen[-1][1]
    assert fence["pending"] == last and fence["verified"] == len(PROMPT)
    assert len(store.read_manifest("d").pending) == len(last) + 1  # the failed page, in the page cache
    s.abandon()
    again = store.open("d", "tiny")
    assert again.history() == PROMPT + last == stream[:len(PROMPT) + len(last)]
    assert not (store.session_dir("d") / FENCE_NAME).exists()
    assert again.generate(None, 3).tokens == stream[len(PROMPT) + len(last):len(PROMPT) + len(last) + 3]
    again.close()


def test_a_failed_shared_barrier_fences_and_the_reopen_keeps_the_last_tail_that_returned(
        tmp_path, tiny, monkeypatch) -> None:
    """The same failure when the tail commits run under a shared barrier (:func:`commit_together`,
    as a server's group runs them): the 4th ``syncfs`` fails, the session is fenced, that commit
    released nothing, and the reopen keeps the last tail whose barrier returned."""
    if not committer_module.syncfs_available():
        pytest.skip("no syncfs(2) on this system: tail commits are never shared")
    stream = _stream(tiny, 12)
    store = SessionStore(tmp_path)
    store.adopt_model("tiny", tiny)
    s = store.create("d", "tiny", kv_dtype="fp8", sampler=SAMPLER, options=DURABLE)
    s.generate(PROMPT, 1)
    s.close()
    real, barriers = committer_module.syncfs, []

    def failing(fd: int) -> None:
        barriers.append(fd)
        if len(barriers) == 4:
            raise OSError(errno.EIO, "injected")
        real(fd)

    monkeypatch.setattr(committer_module, "syncfs", failing)

    def runner(commit: Any, *, overlap: bool = False) -> None:
        assert isinstance(commit, BarrierCommit) and commit.share is not None  # every one a tail commit
        error = commit_together([commit])[0]
        if error is not None:
            raise error

    s = store.open("d", "tiny", options=replace(DURABLE, commit_runner=runner))
    watch = Watch(store, "d")
    s.commit_watch = watch
    with pytest.raises(SessionFencedError):
        s.generate(None, 8)
    assert len(barriers) == 4 and len(watch.seen) == 3  # the 4th barrier failed: it released nothing
    fence = json.loads((store.session_dir("d") / FENCE_NAME).read_text())
    last = watch.seen[-1][1]
    assert fence["pending"] == last and fence["verified"] == len(PROMPT)
    s.abandon()
    again = store.open("d", "tiny")
    assert again.history() == PROMPT + last == stream[:len(PROMPT) + len(last)]
    assert again.generate(None, 3).tokens == stream[len(PROMPT) + len(last):len(PROMPT) + len(last) + 3]
    again.close()
