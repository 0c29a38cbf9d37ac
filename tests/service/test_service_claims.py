"""A job's session claim on the engine: held while the job runs (a second request is refused with
409), free before the job's ``then`` runs, so what ``then`` makes visible (a stored response a
client polls for, then continues) can be acted on at once, never answered "busy". A request on a
session whose holder's turn has ended (its last token drawn, its client gone) waits for its release,
in order and within a bound (then 409), never holding up other sessions or the engine's stop."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from sessionstore.service.engine.engine import Engine
from sessionstore.service.engine.turns import EndingOutput
from sessionstore.service.errors import ApiError
from sessionstore.sessions import SessionStore
from sessionstore.sessions.output import TurnStop


def test_a_jobs_session_is_held_while_it_runs_and_free_when_its_then_runs(tmp_path: Path) -> None:
    engine = Engine(SessionStore(tmp_path), "tiny")
    seen: list[str] = []

    def run() -> int:
        with pytest.raises(ApiError) as refused:
            engine.claim("s")
        seen.append(f"run: {refused.value.status}")
        return 7

    def then(result: int) -> int:
        engine.claim("s")  # free: the job's claim is gone before its then runs
        engine.release("s")
        seen.append(f"then: {result}")
        return result + 1

    try:
        assert engine.submit(run, session="s", turn=True, then=then).result(timeout=60) == 8
        assert seen == ["run: 409", "then: 7"]
    finally:
        engine.stop()


def test_a_job_that_fails_frees_its_session_and_skips_its_then(tmp_path: Path) -> None:
    engine = Engine(SessionStore(tmp_path), "tiny")
    ran: list[object] = []

    def run() -> int:
        raise ValueError("the turn failed")

    try:
        with pytest.raises(ValueError, match="turn failed"):
            engine.submit(run, session="s", then=ran.append).result(timeout=60)
        assert ran == []
        engine.claim("s")  # free again
    finally:
        engine.stop()


# ---- a request on a session whose holder's turn has ended waits for it (the busy rule) -----------------
def test_requests_behind_an_ended_turn_wait_and_run_in_order_while_others_run_at_once(tmp_path: Path) -> None:
    engine = Engine(SessionStore(tmp_path), "tiny")
    ran: list[str] = []
    try:
        engine.claims.take("s")
        engine.claims.end("s")  # its holder drew its last token: it only commits now
        waiting = [engine.submit(lambda i=i: ran.append(f"s{i}"), session="s") for i in range(3)]
        assert engine.submit(lambda: ran.append("t"), session="t").result(timeout=60) is None  # not held up
        assert not any(f.done() for f in waiting) and ran == ["t"]
        engine.release("s")  # handed to the first waiter, whose release hands it on
        for fut in waiting:
            fut.result(timeout=60)
        assert ran == ["t", "s0", "s1", "s2"]
        assert not engine.claims.held("s")
    finally:
        engine.stop()


def test_a_session_held_by_a_turn_still_generating_is_refused_at_once(tmp_path: Path) -> None:
    engine = Engine(SessionStore(tmp_path), "tiny")
    gone = False
    try:
        engine.claims.take("s", cut=lambda: gone)
        with pytest.raises(ApiError) as refused:
            engine.submit(lambda: None, session="s")
        assert (refused.value.status, refused.value.code) == (409, "session_busy")
        gone = True  # its client went away (the stream cut): the turn has ended, a request waits now
        fut = engine.submit(lambda: "served", session="s")
        assert not fut.done()
        engine.release("s")
        assert fut.result(timeout=60) == "served"
    finally:
        engine.stop()


def test_a_claim_not_released_within_the_bound_gives_the_409(tmp_path: Path) -> None:
    engine = Engine(SessionStore(tmp_path), "tiny")
    engine.claims.wait_s = 0.3
    ran: list[int] = []
    try:
        engine.claims.take("s")
        engine.claims.end("s")
        t0 = time.monotonic()
        fut = engine.submit(lambda: ran.append(1), session="s")
        error = fut.exception(timeout=30)
        waited = time.monotonic() - t0
        assert isinstance(error, ApiError) and (error.status, error.code) == (409, "session_busy")
        assert 0.3 <= waited < 10, waited
        engine.release("s")
        assert ran == [] and not engine.claims.held("s")  # the expired request never ran, nor holds it
    finally:
        engine.stop()


def test_stop_ends_promptly_with_requests_waiting(tmp_path: Path) -> None:
    engine = Engine(SessionStore(tmp_path), "tiny")
    engine.claims.wait_s = 600.0  # a wait that would outlast any test: stop must not wait for it
    ran: list[int] = []
    engine.claims.take("s")
    engine.claims.end("s")
    waiting = [engine.submit(lambda: ran.append(1), session="s") for _ in range(2)]
    t0 = time.monotonic()
    engine.stop()
    assert time.monotonic() - t0 < 30
    for fut in waiting:
        error = fut.exception(timeout=1)
        assert isinstance(error, ApiError) and (error.status, error.code) == (503, "shutting_down")
    engine.release("s")  # the holder ends after the stop: nothing is started
    assert ran == []


def test_an_ending_output_says_when_its_last_token_is_drawn() -> None:
    ends: list[int] = []
    output = EndingOutput(3, lambda: ends.append(len(output.tokens)), eos=frozenset({9}))
    for token in (1, 2):
        output.on_token(token, 0)
    assert ends == []
    output.on_token(3, 0)  # the max_new-th
    assert ends == [3]
    ends.clear()
    early = EndingOutput(5, lambda: ends.append(len(early.tokens)), eos=frozenset({9}))
    early.on_token(1, 0)
    with pytest.raises(TurnStop):
        early.on_token(9, 0)  # eos ends it before max_new
    assert ends == [2]
