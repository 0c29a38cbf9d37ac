"""A session's file work runs off the engine loop's thread: creating a session (its kv file, sidecar,
manifest, their fsyncs, the catalogue's row) and resuming one (the lock, the mapping) run on the
loop's I/O threads while the loop steps the other sessions on, so a slow disk under a new session
does not stall the streams already running; the new session's tokens stay exact."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kernels.model.sampling import Sampler
from sessionstore.kvfile.durability import Durability
from sessionstore.service.engine.engine import Engine
from sessionstore.service.engine.turns import TurnSpec
from sessionstore.sessions import SessionStore, reference_turns

SLOW_FSYNC_S = 0.4  # each fsync while the new session is made: several decode steps' worth, many times over
RUNNING_TOKENS = 400  # the running stream's length: it is still running when the new session is made


class TimedSink:
    """Records when each piece of text arrives; ``started`` is set at the first."""

    def __init__(self, after: int = 1) -> None:
        self.times: list[float] = []
        self.after, self.started = after, threading.Event()

    def text(self, piece: str, logprobs: Any = None) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) >= self.after:
            self.started.set()

    def cancelled(self) -> bool:
        return False


def test_a_slow_fsync_while_a_session_is_created_does_not_stall_a_running_stream(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = text_model
    slow = threading.Event()
    slow_on: list[str] = []
    real_fsync = Durability.fsync

    def slow_fsync(self: Durability, fd: int) -> None:
        if slow.is_set():  # a slow disk under the new session's files
            slow_on.append(threading.current_thread().name)
            time.sleep(SLOW_FSYNC_S)
        real_fsync(self, fd)

    monkeypatch.setattr(Durability, "fsync", slow_fsync)
    store = SessionStore(tmp_path)
    engine = Engine(store, str(text_model_dir), tokenizer=tok, session_options={"commit_every": 4096})
    running, new = TimedSink(after=5), TimedSink()
    run_spec = TurnSpec("completion", "run", prompt=[7, 40, 41, 200, 9], max_tokens=RUNNING_TOKENS, ignore_eos=True,
                        sampling={"seed": 1})
    new_spec = TurnSpec("completion", "new", prompt=[11, 12, 13, 14], max_tokens=8, ignore_eos=True,
                        sampling={"temperature": 0.8, "seed": 2})
    try:
        run_fut = engine.submit(lambda: engine.run_turn(run_spec, running), session="run", turn=True)
        assert running.started.wait(60)
        slow.set()
        t0 = time.perf_counter()
        new_fut = engine.submit(lambda: engine.run_turn(new_spec, new), session="new", turn=True)
        assert new.started.wait(60)
        made = new.times[0] - t0
        slow.clear()
        outcome = new_fut.result(60)
        run_fut.result(120)
    finally:
        slow.clear()
        engine.stop()
    assert slow_on and made >= SLOW_FSYNC_S, (slow_on, made)  # the slow fsyncs did hold up the creation
    during = [b - a for a, b in zip(running.times, running.times[1:], strict=False) if b > t0 and a < t0 + made]
    assert during, "the running stream had ended before the new session was made: raise RUNNING_TOKENS"
    assert max(during) < SLOW_FSYNC_S / 2, f"the running stream stalled {max(during) * 1e3:.0f} ms"
    assert all(name.startswith("coli-engine-io") for name in slow_on), slow_on  # on the loop's I/O threads
    want = reference_turns(model, "fp8", [(new_spec.prompt, 8)], Sampler(temperature=0.8, seed=2))[0]
    assert outcome.tokens == want and outcome.created
