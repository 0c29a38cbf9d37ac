"""Durable streaming in process, on the engine: each piece of text is on disk (the kv commit and the
state page it covers) before the sink gets it; commits slower than the steps coalesce (one commit
covers the tokens drawn while the previous one ran) instead of holding the steps back; the tokens
are the uninterrupted run's."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.model.sampling import Sampler
from sessionstore.kvfile import KVWriter
from sessionstore.kvfile.durability import Durability
from sessionstore.service.engine.engine import Engine
from sessionstore.service.wire.turn_spec import TurnSpec
from sessionstore.sessions import SessionOptions, SessionStore, reference_turns
from sessionstore.sessions import committer as committer_module

MAX_NEW = 40
SLOW_FSYNC_S = 0.02


def _prompt(i: int) -> list[int]:
    return [7 + i, 40, 41 + 3 * i, 200, 9]


class CheckingSink:
    """Checks, as each piece arrives, that the session's committed reply on disk already holds
    every piece sent so far (read as any reader would: manifest, state page, kv file)."""

    def __init__(self, store: SessionStore, sid: str, tok: Any, prompt_len: int) -> None:
        self.store, self.sid, self.tok, self.prompt_len = store, sid, tok, prompt_len
        self.sent = ""
        self.pieces = 0
        self.problems: list[str] = []

    def text(self, piece: str, logprobs: Any = None) -> None:
        self.sent += piece
        self.pieces += 1
        on_disk = self.tok.decode(self.store.history(self.sid)[self.prompt_len:])
        if not on_disk.startswith(self.sent):
            self.problems.append(f"sent {self.sent!r}, on disk {on_disk!r}")

    def cancelled(self) -> bool:
        return False


def test_each_piece_is_durable_before_it_is_sent_and_slow_commits_coalesce(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = text_model
    real_fsync = Durability.fsync

    def slow_fsync(self: Durability, fd: int) -> None:
        time.sleep(SLOW_FSYNC_S)  # a slow disk: each commit takes several steps
        real_fsync(self, fd)

    monkeypatch.setattr(Durability, "fsync", slow_fsync)
    commits: dict[str, int] = {}
    real_commit = KVWriter.commit
    lock = threading.Lock()

    def counting_commit(self: KVWriter, **kw: Any) -> int:
        with lock:
            key = Path(self.path).parent.name
            commits[key] = commits.get(key, 0) + 1
        return real_commit(self, **kw)

    monkeypatch.setattr(KVWriter, "commit", counting_commit)
    store = SessionStore(tmp_path)
    engine = Engine(store, str(text_model_dir), tokenizer=tok,
                    session_options=SessionOptions(commit_every=16, durable_stream=True,
                                                   lazy_logits=True))
    sampling = {"temperature": 0.8, "top_p": 0.9}
    try:
        sinks = {f"s{i}": CheckingSink(store, f"s{i}", tok, len(_prompt(i))) for i in range(3)}
        specs = {sid: TurnSpec("completion", sid, prompt=_prompt(i), max_tokens=MAX_NEW, ignore_eos=True,
                               sampling={**sampling, "seed": i})
                 for i, sid in enumerate(sinks)}
        t0 = time.perf_counter()
        futures = {sid: engine.submit(lambda s=spec, k=sinks[sid]: engine.run_turn(s, k), session=sid, turn=True)
                   for sid, spec in specs.items()}
        outcomes = {sid: fut.result(timeout=300) for sid, fut in futures.items()}
        took = time.perf_counter() - t0
    finally:
        engine.stop()
    for i, (sid, sink) in enumerate(sinks.items()):
        assert not sink.problems, sink.problems[:3]
        want = reference_turns(model, "fp8", [(_prompt(i), MAX_NEW)], Sampler(**sampling, seed=i))[0]
        assert outcomes[sid].tokens == want
        assert sink.sent == tok.decode(want)  # every piece went out once the turn ended
        assert store.history(sid) == _prompt(i) + want
        # slow commits coalesce: far fewer mid-turn commits than tokens (one per token would be 40)
        assert commits[sid] < MAX_NEW // 2, commits
    # one commit per token, one after another, would take 40 x 3 fsyncs x 20 ms = 2.4 s per session
    print(f"3 sessions x {MAX_NEW} tokens with {SLOW_FSYNC_S * 1e3:.0f} ms fsyncs: {took:.2f} s, commits {commits}")
    assert took < MAX_NEW * 3 * SLOW_FSYNC_S, f"{took:.2f} s: the steps waited for the commits"


SLOW_BARRIER_S = 0.03
BARRIER_TOKENS = 120  # tokens a stream of that test runs: long enough to span several barriers however fast a step is


def test_a_slow_shared_barrier_delays_the_text_not_the_steps(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The tail commits of a step share one barrier (``syncfs``), made slow on purpose: the steps
    run on while it is in flight (steps start inside the barriers' windows, and the run takes far
    less than one barrier per token would) while each stream's text waits for them (pauses of a
    barrier's length; each piece on disk before it is sent), each stream's text is its
    uninterrupted run's, in order, and the barriers were coalesced (fewer than the tokens)."""
    if not committer_module.syncfs_available():
        pytest.skip("no syncfs(2) on this system: tail commits sync one by one")
    model, tok = text_model
    real_syncfs = committer_module.syncfs
    windows: list[tuple[float, float]] = []

    def slow_syncfs(fd: int) -> None:
        t0 = time.perf_counter()
        time.sleep(SLOW_BARRIER_S)  # a slow disk: each barrier spans several steps
        real_syncfs(fd)
        windows.append((t0, time.perf_counter()))

    monkeypatch.setattr(committer_module, "syncfs", slow_syncfs)
    store = SessionStore(tmp_path)
    engine = Engine(store, str(text_model_dir), tokenizer=tok,
                    session_options=SessionOptions(commit_every=16, durable_stream=True, lazy_logits=True))
    steps: list[tuple[float, float]] = []
    observe = engine.loop.batch.on_forward

    def timed(kind: str, sessions: int, seconds: float) -> None:
        steps.append((time.perf_counter() - seconds, time.perf_counter()))
        if observe is not None:
            observe(kind, sessions, seconds)

    engine.loop.batch.on_forward = timed
    sampling = {"temperature": 0.8, "top_p": 0.9}
    sinks = {f"s{i}": TimedSink(store, f"s{i}", tok, len(_prompt(i))) for i in range(3)}
    try:
        specs = {sid: TurnSpec("completion", sid, prompt=_prompt(i), max_tokens=BARRIER_TOKENS, ignore_eos=True,
                               sampling={**sampling, "seed": i})
                 for i, sid in enumerate(sinks)}
        t0 = time.perf_counter()
        futures = {sid: engine.submit(lambda s=spec, k=sinks[sid]: engine.run_turn(s, k), session=sid, turn=True)
                   for sid, spec in specs.items()}
        outcomes = {sid: fut.result(timeout=300) for sid, fut in futures.items()}
        took = time.perf_counter() - t0
    finally:
        engine.stop()
    tails = sum(1 for _ in windows)
    for i, (sid, sink) in enumerate(sinks.items()):
        assert not sink.problems, sink.problems[:3]
        want = reference_turns(model, "fp8", [(_prompt(i), BARRIER_TOKENS)], Sampler(**sampling, seed=i))[0]
        assert outcomes[sid].tokens == want
        assert sink.sent == tok.decode(want)  # every piece, in order
        # the text waited for the slow barriers (pauses of a barrier's length between its pieces)
        # while the steps ran on (below)
        assert any(g >= 0.8 * SLOW_BARRIER_S for g in np.diff(sink.times)), np.diff(sink.times)
    during = [s for s in steps if any(b0 < s[0] < b1 for b0, b1 in windows)]
    print(f"3 sessions x {BARRIER_TOKENS} tokens, {SLOW_BARRIER_S * 1e3:.0f} ms shared barriers: {took:.2f} s, "
          f"{tails} barriers, {len(steps)} steps, {len(during)} started while a barrier was in flight")
    # steps waiting for the barriers would start none inside one; each 30 ms barrier spans many steps
    assert len(during) >= 2 * len(windows), "the steps waited for the barriers"
    assert took < BARRIER_TOKENS * SLOW_BARRIER_S, f"{took:.2f} s: the steps waited for the barriers"
    assert tails < BARRIER_TOKENS, f"{tails} barriers for {BARRIER_TOKENS} tokens: not coalesced"


class TimedSink(CheckingSink):
    """A :class:`CheckingSink` that also notes when each piece arrived."""

    def __init__(self, store: SessionStore, sid: str, tok: Any, prompt_len: int) -> None:
        super().__init__(store, sid, tok, prompt_len)
        self.times: list[float] = []

    def text(self, piece: str, logprobs: Any = None) -> None:
        self.times.append(time.perf_counter())
        super().text(piece, logprobs)
