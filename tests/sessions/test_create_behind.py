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
        assert s.state == "resident" and s.files.being_made and not store.exists("n")

        def on_token(token: int, position: int) -> None:
            seen.append((position, s.files.being_made, store.exists("n")))
            starter.gate.set()  # the slow disk finishes only now

        r = s.generate(PROMPT, 4, on_token=on_token)
    finally:
        starter.close()
    assert starter.held_until_gate  # made after the first token, not before it
    assert seen[0] == (len(PROMPT), True, False)  # drawn while nothing of the session was on disk
    assert r.committed == len(PROMPT) + 3 and not s.files.being_made  # the turn's commit waited for the files
    assert len(_records(store, "n")[0]) == len(PROMPT) + 3
    s.close()


def test_a_failed_creation_fails_the_first_commit_and_leaves_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStore(tmp_path)

    def full(*_a: Any, **_k: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.directory, "install_dir", full)
    s = store.create("n", "tiny", options=SessionOptions(io_start=DeferredStarter(on_poll=False)))
    with pytest.raises(OSError, match="No space"):
        s.generate(PROMPT, 3)
    assert s.state == "suspended" and store.residency.sessions() == [] and not store.exists("n")
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
    assert s.state == "suspended" and store.residency.sessions() == []
    reopened = store.open("n")
    assert reopened.history() == [] and reopened.committed == 0
    reopened.close()


def test_an_id_that_is_taken_is_refused_at_once(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    store.create("n", "tiny").close()
    with pytest.raises(Exception, match="already exists"):
        store.create("n", "tiny", options=SessionOptions(io_start=DeferredStarter(on_poll=True)))


@pytest.mark.parametrize("kv", ["fp8", "polar4"])
def test_a_glm_session_made_behind_its_first_turn_is_token_exact(tmp_path: Path, tiny_glm_dir: Path,
                                                                 kv: str) -> None:
    """The DSA decoder (indexer rows beside the latent ones): the first turn runs on a fresh
    cache, not one built over the file's blocks; the tokens are the reference's all the same,
    and the reopened session continues them exactly."""
    from kernels.model import load_model
    from sessionstore.sessions.turn_loop import reference_turns

    prompt = list(b"The indexer picks the rows that matter most.")  # 44 tokens > index_topk 16
    store = SessionStore(tmp_path)
    starter = HeldStarter(hold_s=0.0)
    try:
        s = store.create("g", tiny_glm_dir, kv_dtype=kv, sampler=SAMPLER,
                         options=SessionOptions(commit_every=3, io_start=starter))
        first = s.generate(prompt, 10).tokens
        s.close()
    finally:
        starter.close()
    again = store.open("g")
    second = again.generate(None, 7).tokens
    again.close()
    assert [first, second] == reference_turns(load_model(tiny_glm_dir), kv, [(prompt, 10), (None, 7)], SAMPLER)


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.3])
def test_sigkill_while_a_new_session_is_made_loses_nothing_committed(tmp_path: Path, tiny: Any,
                                                                     delay_s: float) -> None:
    """A real SIGKILL during the first turn of a session whose files are made ``delay_s`` late
    on a thread (before they exist, while they are made, after the first commits): the session
    is absent only if no commit was acknowledged, and otherwise holds every acknowledged commit
    and a prefix of the uninterrupted run."""
    import random
    import signal
    import time

    from sessionstore.sessions.turn_loop import reference_turns
    from tests.support.session_util import spawn_child

    rng = random.Random(f"behind-{delay_s}")
    total, commit_every = 120, 4
    stream = PROMPT + reference_turns(tiny, "fp8", [(PROMPT, total)], SAMPLER)[0]
    for attempt in range(3):
        root = str(tmp_path / f"r{attempt}")
        job = {"id": "s", "max_new": total, "commit_every": commit_every, "prompt": PROMPT,
               "create": {"kv": "fp8", "sampler": [0.9, 50, 0.95, 4242]}, "create_behind": {"delay_s": delay_s}}
        proc = spawn_child({"root": root, "jobs": [job], "stream": True})
        seen, made, after_made, stop_after = 0, False, 0, rng.randint(1, 30)
        while seen < stop_after:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            seen += line.startswith("tok ")
            after_made += made and line.startswith("tok ")
            made = made or line.startswith("made")
        time.sleep(rng.random() * 0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        store = SessionStore(root)
        if not store.exists("s"):
            assert not made, (seen, made)  # made: installed durably before it said so
            continue
        s = store.open("s")
        history = s.history()
        assert history == stream[:len(history)]
        # the commits due while the files were made wait for them (never the loop): from the
        # second token after they were attached on, line j printed means step j-1's commit returned
        if after_made >= 3:
            assert len(history) >= len(PROMPT) + seen - 1 - commit_every, (seen, after_made, len(history))
        s.close()
