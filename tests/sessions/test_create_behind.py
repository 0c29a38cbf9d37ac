"""A new session's first token waits for no disk (issue 36 part 3): with ``io_start`` its kv file,
sidecar, manifest, state page and catalogue row are made on an I/O thread while its first turn's
prompt is prefilled and its first token drawn; its first commit waits for them. The tokens and
the committed records are the same as when the files are made first, and a making that fails
or is abandoned loses nothing committed (nothing was)."""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from kernels.model.sampling import Sampler
from sessionstore.kvfile import open_kv
from sessionstore.sessions import SessionOptions, SessionStore
from tests.support.io_starters import DeferredStarter, HeldStarter

PROMPT = list(b"Once upon a time")
SAMPLER = Sampler(0.9, 50, 0.95, 4242)


def _records(store: SessionStore, sid: str) -> tuple[list[int], bytes]:
    with open_kv(store.kv_path(sid)) as reader:
        n = reader.nrec
        return [int(t) for t in reader.tokens[:n]], bytes(reader.records_bytes_view(0, n))


@pytest.mark.parametrize("kv", ["fp8", "f32", "int4"])
def test_made_behind_the_first_turn_gives_the_same_tokens_and_records(tmp_path: Path, kv: str) -> None:
    first, behind = SessionStore(tmp_path / "a"), SessionStore(tmp_path / "b")
    starter = HeldStarter(hold_s=0.0)
    try:
        a = first.create("s", "tiny", kv_dtype=kv, sampler=SAMPLER, options=SessionOptions(commit_every=5))
        b = behind.create("s", "tiny", kv_dtype=kv, sampler=SAMPLER,
                          options=SessionOptions(commit_every=5, io_start=starter))
        ta = a.generate(PROMPT, 12).tokens + a.generate(None, 7).tokens
        tb = b.generate(PROMPT, 12).tokens + b.generate(None, 7).tokens
        assert ta == tb and a.committed == b.committed == len(PROMPT) + 18
        a.close()
        b.close()
    finally:
        starter.close()
    assert _records(first, "s") == _records(behind, "s")
    reopened = behind.open("s")
    assert reopened.history() == PROMPT + ta and reopened.resume_report["checksums"].startswith("34 record(s)")
    reopened.close()
    assert behind.catalogue.get("s") is not None


def test_the_first_token_does_not_wait_for_a_slow_creation_the_commit_does(tmp_path: Path) -> None:
    """The making is held back (a disk whose fsyncs take seconds) until the first token is drawn:
    were the token waiting for the files, the making would time out first (held_until_gate False)."""
    store = SessionStore(tmp_path)
    starter = HeldStarter(hold_s=20.0)
    seen: list[tuple[int, bool, bool]] = []
    try:
        s = store.create("n", "tiny", sampler=SAMPLER, options=SessionOptions(commit_every=None, io_start=starter))
        assert s.state == "resident" and s.files_pending and not store.exists("n")

        def on_token(token: int, position: int) -> None:
            seen.append((position, s.files_pending, store.exists("n")))
            starter.gate.set()  # the slow disk finishes only now

        r = s.generate(PROMPT, 4, on_token=on_token)
    finally:
        starter.close()
    assert starter.held_until_gate  # made after the first token, not before it
    assert seen[0] == (len(PROMPT), True, False)  # drawn while nothing of the session was on disk
    assert r.committed == len(PROMPT) + 3 and not s.files_pending  # the turn's commit waited for the files
    assert len(_records(store, "n")[0]) == len(PROMPT) + 3
    s.close()


def test_a_failed_creation_fails_the_first_commit_and_leaves_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStore(tmp_path)

    def full(*_a: Any, **_k: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "install_dir", full)
    s = store.create("n", "tiny", options=SessionOptions(io_start=DeferredStarter(on_poll=False)))
    with pytest.raises(OSError, match="No space"):
        s.generate(PROMPT, 3)
    assert s.state == "suspended" and store.resident_sessions() == [] and not store.exists("n")
    assert store.catalogue.get("n") is None
    monkeypatch.undo()
    again = store.create("n", "tiny")  # the id is free: nothing was left behind, no lock held
    again.close()


def test_abandoned_before_its_files_are_made_releases_them_once_made(tmp_path: Path) -> None:
    """A crash-like release (abandon) while the files are being made waits for them, then lets
    go of the writer's lock: the session reopens empty (nothing was committed)."""
    store = SessionStore(tmp_path)
    starter = HeldStarter(hold_s=20.0)
    try:
        s = store.create("n", "tiny", options=SessionOptions(io_start=starter))
        s.model.forward(s.model.check_tokens(PROMPT), s.cache)  # a prefill, nothing handed over
        starter.gate.set()
        s.abandon()
    finally:
        starter.close()
    assert s.state == "suspended" and store.resident_sessions() == []
    reopened = store.open("n")
    assert reopened.history() == [] and reopened.committed == 0
    reopened.close()


def test_an_id_that_is_taken_is_refused_at_once(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    store.create("n", "tiny").close()
    with pytest.raises(Exception, match="already exists"):
        store.create("n", "tiny", options=SessionOptions(io_start=DeferredStarter(on_poll=True)))
