"""A request that resumes a suspended session runs its first step beside the checksum pass (issue 36
part 4): the step's result is held until the pass has passed, nothing is sent or committed before;
a failed pass fails the turn with the serial check's error, releases the session and leaves its
files as they were; another request on the session meanwhile gets the busy answer.

In process (an Engine on the test model, no HTTP); each test well under 3 s once numba's cache is warm."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sessionstore.kvfile.integrity as integrity
from kernels.errors import ChecksumMismatchError
from kernels.model.sampling import Sampler
from sessionstore.kvfile import HEADER_SIZE, open_kv
from sessionstore.service.engine.engine import Engine
from sessionstore.service.errors import ApiError
from sessionstore.service.wire.turn_spec import TurnSpec
from sessionstore.sessions import KV_NAME, MANIFEST_NAME, SIDECAR_NAME, SessionOptions, SessionStore, reference_turns
from sessionstore.sessions.resident_files import ResidentFiles

FIRST = [7, 40, 41, 200, 9, 13, 77, 5]  # the first turn's prompt


class Sink:
    """Collects the turn's pieces."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def text(self, piece: str, logprobs: Any = None) -> None:
        self.pieces.append(piece)

    def cancelled(self) -> bool:
        return False


@pytest.fixture
def engine(tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any]) -> Any:
    store = SessionStore(tmp_path)
    eng = Engine(store, str(text_model_dir), tokenizer=text_model[1],
                 session_options=SessionOptions(lazy_logits=True))
    yield eng
    eng.stop()


def _turn(engine: Engine, prompt: list[int], sink: Sink | None = None, max_tokens: int = 4) -> Any:
    spec = TurnSpec("completion", "s", prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                    sampling={"temperature": 0})
    return engine.submit(lambda: engine.run_turn(spec, sink or Sink()), session="s", turn=True)


def _suspended(engine: Engine) -> list[int]:
    """Session ``s`` made by a first turn and suspended; the second turn's prompt (its records, then a
    token other than the pending one: one token fed, nothing truncated)."""
    first = _turn(engine, FIRST).result(60)
    engine.submit(lambda: engine.suspend("s"), session="s").result(60)
    return [*FIRST, *first.tokens[:-1], 31]  # the drawn tokens but the pending one are records


def _files(engine: Engine) -> dict[str, bytes]:
    d = engine.store.root / "sessions" / "s"
    return {name: (d / name).read_bytes() for name in (KV_NAME, SIDECAR_NAME, MANIFEST_NAME)}


class Gate:
    """Holds the pass beside (its thread, ``coli-vouch``) at its first hash until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open, self.reached = threading.Event(), threading.Event()
        real = integrity.hash_records

        def held(reader: Any, start: int, stop: int) -> np.ndarray:
            if threading.current_thread().name == "coli-vouch":
                self.reached.set()
                assert self.open.wait(30)
            return real(reader, start, stop)

        monkeypatch.setattr(integrity, "hash_records", held)


def held_turn(engine: Engine, prompt: list[int], monkeypatch: pytest.MonkeyPatch) -> tuple[Gate, Sink, Any]:
    """A turn on the suspended session with its checksum pass held at the gate: (gate, sink, future),
    once the turn's first step has run on the unchecked rows."""
    gate = Gate(monkeypatch)
    steps = engine.loop.batch.steps
    sink = Sink()
    fut = _turn(engine, prompt, sink)
    assert gate.reached.wait(30)
    assert first_step_runs(engine, steps), "the first step waited for the pass"
    return gate, sink, fut


def first_step_runs(engine: Engine, steps: int) -> bool:
    """Whether the engine takes a step past ``steps`` within 3 s (the turn's first, while the pass is held)."""
    for _ in range(300):
        if engine.loop.batch.steps > steps:
            return True
        threading.Event().wait(0.01)
    return engine.loop.batch.steps > steps


def test_a_good_resume_beside_is_token_exact_and_its_step_runs_before_the_pass_ends(
        engine: Engine, text_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = _suspended(engine)
    gate, sink, fut = held_turn(engine, prompt, monkeypatch)
    threading.Event().wait(0.05)
    assert sink.pieces == [] and not fut.done()  # held: nothing sent, the turn not done
    with pytest.raises(ApiError) as busy:  # another request on the session meanwhile: today's busy answer
        _turn(engine, prompt)
    assert busy.value.status == 409
    gate.open.set()
    outcome = fut.result(60)
    model = text_model[0]
    want = reference_turns(model, "fp8", [(FIRST, 4), (prompt, 4)], Sampler(temperature=0))
    assert outcome.tokens == want[1] and len(sink.pieces) >= 1
    report = engine.submit(lambda: engine.open_session("s", create=False)[0].resume_report, session="s").result(60)
    assert str(report["checksums"]) == f"{len(prompt) - 1} record(s) match their checksums"  # checked, all of them


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_corrupt_record_fails_the_turn_sends_nothing_and_leaves_the_files(
        engine: Engine, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = _suspended(engine)
    kv = engine.store.root / "sessions" / "s" / KV_NAME
    with open_kv(kv) as reader:
        n, rec = reader.nrec, reader.record_bytes
    position = 0 if where == "first" else n - 1  # the last record: in the last block the pass checks
    offset = HEADER_SIZE + position * rec + rec // 2
    raw = bytearray(kv.read_bytes())
    raw[offset] ^= 0x5A
    kv.write_bytes(bytes(raw))
    before = _files(engine)
    gate, sink, fut = held_turn(engine, prompt, monkeypatch)  # the step ran on the unchecked rows, and was held
    gate.open.set()
    with pytest.raises(ChecksumMismatchError, match=f"resume of .* refused: .*record at position {position}"):
        fut.result(60)
    assert sink.pieces == []  # no token sent
    assert _files(engine) == before  # nothing committed, nothing repaired: the files as they were
    assert engine.state_of("s") != "resident"  # released: its lock and mapping let go
    with pytest.raises(ChecksumMismatchError):  # and refused again, the files still untouched
        _turn(engine, prompt).result(60)
    assert _files(engine) == before


def test_a_pass_that_ends_before_the_mapping_is_still_the_turns_to_take(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session suspended as the server suspends it resumes with its pass beside even when the pass
    ends before the rows are mapped (a quiet host: 87 ms of pass, ~110 ms of resume): the turn still
    takes its result and the report says it ran beside (bench.serve read such resumes as serial)."""
    prompt = _suspended(engine)
    ended = threading.Event()
    real_check, real_map = integrity.check_hashes, ResidentFiles.map

    def check(*args: Any, **kwargs: Any) -> None:
        real_check(*args, **kwargs)
        if threading.current_thread().name == "coli-vouch":
            ended.set()

    def late_map(self: ResidentFiles, *args: Any) -> None:
        assert ended.wait(30), "the pass did not run beside"
        real_map(self, *args)

    monkeypatch.setattr(integrity, "check_hashes", check)
    monkeypatch.setattr(ResidentFiles, "map", late_map)
    _turn(engine, prompt).result(60)
    report = engine.submit(lambda: engine.open_session("s", create=False)[0].resume_report, session="s").result(60)
    assert str(report["checksums"]) == f"{len(prompt) - 1} record(s) match their checksums"
    assert report["check_s"] > 0 and report["check_wait_s"] >= 0  # taken by the turn: the pass ran beside
