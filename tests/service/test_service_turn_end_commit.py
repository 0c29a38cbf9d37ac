"""A turn that ends early (a cancel, a stop string, eos: the output processor's TurnStop) commits on
the engine loop's I/O threads like every other commit: while its fsyncs wait, the loop steps the other
sessions on (issue 36 part 2). Asserted by order, not speed: the ending turn's first fsync is held until
another session's stream has drawn more tokens; a commit on the loop's own thread would hold that stream
too, and the held fsync would give up waiting."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from sessionstore.kvfile.durability import Durability
from sessionstore.service.engine.engine import Engine
from sessionstore.service.wire.turn_spec import TurnSpec
from sessionstore.sessions import SessionOptions, SessionStore

MORE_PIECES = 3  # the running stream's pieces that must arrive while the ending turn's fsync is held
GIVE_UP_S = 20.0  # how long the held fsync waits for them (only a failing run waits this long)


class Sink:
    """Counts the pieces of text; ``on_piece(n)`` after the n-th; cancelled once ``stop_when()``."""

    def __init__(self, stop_when: Any = None) -> None:
        self.pieces = 0
        self.cond = threading.Condition()
        self.stop_when = stop_when or (lambda: False)

    def text(self, piece: str, logprobs: Any = None) -> None:
        with self.cond:
            self.pieces += 1
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.pieces >= n, timeout)

    def cancelled(self) -> bool:
        return bool(self.stop_when())


def _in_session(root: Path, session: str, fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(root / "sessions" / session) + "/")
    except OSError:
        return False


def spec_for(kind: str, session: str, max_tokens: int) -> TurnSpec:
    if kind == "chat":
        return TurnSpec("chat", session, messages=[{"role": "user", "content": f"hello {max_tokens}"}],
                        max_tokens=max_tokens, ignore_eos=True, sampling={"seed": 3})
    return TurnSpec("completion", session, prompt=[7, 40, 41, 200, 9 + max_tokens % 50], max_tokens=max_tokens,
                    ignore_eos=True, sampling={"seed": 3})


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names a descriptor's file through /proc")
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_slow_commit_at_a_cancelled_turns_end_does_not_hold_another_sessions_tokens(
        kind: str, tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, tok = text_model
    ending_now = threading.Event()  # set when the ending turn is cancelled: its end commit follows
    done = threading.Event()  # the test has seen what it needs: the running stream may end
    held: list[tuple[str, bool]] = []  # (thread, whether the running stream drew on meanwhile)
    real, claim = Durability.fsync, threading.Lock()  # the first fsync under the ending session is held

    def held_fsync(self: Durability, fd: int) -> None:
        if ending_now.is_set() and _in_session(store.root, "ending", fd) and claim.acquire(blocking=False):
            before = running.pieces
            held.append((threading.current_thread().name, running.wait_for(before + MORE_PIECES, GIVE_UP_S)))
        real(self, fd)

    monkeypatch.setattr(Durability, "fsync", held_fsync)
    store = SessionStore(tmp_path)
    engine = Engine(store, str(text_model_dir), tokenizer=tok,
                    session_options=SessionOptions(commit_every=4096, lazy_logits=True))
    running = Sink(stop_when=done.is_set)
    ending = Sink(stop_when=lambda: ending.pieces >= 2 and (ending_now.set() or True))
    try:  # the ending session made first (its creation's fsyncs are not the ones held)
        engine.submit(lambda: engine.run_turn(spec_for(kind, "ending", 1), Sink()), session="ending",
                      turn=True).result(60)
        run_fut = engine.submit(lambda: engine.run_turn(spec_for(kind, "run", 4000), running), session="run",
                                turn=True)
        assert running.wait_for(3, 60)
        outcome = engine.submit(lambda: engine.run_turn(spec_for(kind, "ending", 64), ending), session="ending",
                                turn=True).result(60)
        done.set()
        run_fut.result(60)
    finally:
        done.set()
        engine.stop()
    assert outcome.finish == "abort" and 2 <= len(outcome.tokens) < 64, (outcome.finish, outcome.tokens)
    assert held, "the cancelled turn's end commit fsynced none of its session's files"
    (thread, drew_on), = held
    assert drew_on, f"the running stream drew no {MORE_PIECES} tokens while the end commit's fsync waited ({thread})"
    assert thread != engine.loop.thread.name, thread
    after = SessionStore(tmp_path)  # what the turn drew is committed: a fresh reader of the store sees it
    assert after.history("ending")[-len(outcome.tokens):] == outcome.tokens
