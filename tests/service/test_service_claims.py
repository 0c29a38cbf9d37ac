"""A job's session claim on the engine: held while the job runs (a second request is refused with
409), free before the job's ``then`` runs, so what ``then`` makes visible (a stored response a
client polls for, then continues) can be acted on at once, never answered "busy"."""
from __future__ import annotations

from pathlib import Path

import pytest

from sessionstore.service.engine.engine import Engine
from sessionstore.service.errors import ApiError
from sessionstore.sessions import SessionStore


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
