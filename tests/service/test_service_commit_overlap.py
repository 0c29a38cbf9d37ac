"""Commits beside the step, with real sessions on the engine (in process): a mid-turn commit that
fails while the next batched step runs ends only its own turn, the step that ran beside it is
undone for that session, and the session then continues exactly as the uninterrupted run does;
the other session's turn, sharing those steps, is untouched and exact."""
from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import pytest

from kernels.model.sampling import Sampler
from sessionstore.kvfile import KVWriter
from sessionstore.service.engine.engine import Engine
from sessionstore.service.wire.turn_spec import TurnSpec
from sessionstore.sessions import SessionOptions, SessionStore
from sessionstore.sessions.turn_loop import reference_turns
from tests.service.test_service_units import Sink

MODEL = "tiny"
PROMPT = [72, 105, 33, 32, 87]
MAX_NEW = 24
COMMIT_EVERY = 4


def _failing_second_commit_of(monkeypatch: pytest.MonkeyPatch, session_id: str) -> list[int]:
    """KVWriter.commit raises ENOSPC on the second commit of ``session_id``'s kv file (the first
    mid-turn one after its prompt's); returns the list the failures are counted in."""
    real = KVWriter.commit
    seen: list[int] = []

    def commit(self: KVWriter, **kw: Any) -> int:
        if f"/{session_id}/" in str(self.path):
            seen.append(self.length)
            if len(seen) == 2:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(self, **kw)

    monkeypatch.setattr(KVWriter, "commit", commit)
    return seen


def test_a_failed_commit_beside_the_step_undoes_that_step_and_the_session_continues_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStore(tmp_path)
    engine = Engine(store, MODEL, session_options=SessionOptions(commit_every=COMMIT_EVERY, lazy_logits=True))
    sampler = Sampler()
    model = engine.loop.model
    want = reference_turns(model, "fp8", [(PROMPT, MAX_NEW)], sampler)[0]
    seen = _failing_second_commit_of(monkeypatch, "a")
    real_step = model.step

    # a step as long as a real model's: the turn outlasts making the session's files, so its mid-turn
    # commits run beside steps (tiny's compiled step can end the whole turn before the first commit)
    def slow_step(*args: Any) -> Any:
        time.sleep(0.005)
        return real_step(*args)

    monkeypatch.setattr(model, "step", slow_step)

    specs = {sid: TurnSpec("completion", sid, prompt=list(PROMPT), max_tokens=MAX_NEW, ignore_eos=True)
             for sid in ("a", "b")}
    futures = {sid: engine.submit(lambda s=spec: engine.run_turn(s, Sink()), session=sid, turn=True)
               for sid, spec in specs.items()}
    with pytest.raises(OSError, match="injected"):
        futures["a"].result(timeout=120)
    assert futures["b"].result(timeout=120).tokens == want  # shared the steps, untouched
    assert len(seen) == 2

    session, _ = engine.submit(lambda: engine.open_session("a", create=False)).result()  # still resident
    cache = session.cache
    assert cache is not None
    fed = cache.length - len(PROMPT)  # tokens sampled and fed before the failed commit's turn ended
    assert 0 < fed < MAX_NEW - 1
    assert cache.tokens.tolist() == [*PROMPT, *want[:fed]]
    assert session.pending == [want[fed]], "the step beside the failed commit was not undone"
    engine.stop()  # commits (the disk is back) and suspends: the state above is what is durable

    monkeypatch.undo()
    again = SessionStore(tmp_path).open("a", MODEL)
    assert again.history() == [*PROMPT, *want[:fed], want[fed]]
    rest = again.generate(None, MAX_NEW - fed - 1).tokens  # continues from the pending token
    assert rest == want[fed + 1:]
    again.close()
