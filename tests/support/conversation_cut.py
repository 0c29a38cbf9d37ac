"""A chat turn cut as a process death would cut it: ``Crash`` raised inside the turn, the session
then abandoned uncommitted (what recovery and the message views are tested against)."""
from __future__ import annotations

from typing import Any

import pytest


class Crash(Exception):
    """A simulated process death at a chosen point (the session is then abandoned, uncommitted)."""


def respond_until_crash(conv: Any, messages: list[dict[str, str]], max_new: int, *, checks: int = 7) -> None:
    """``conv.respond(messages, max_new)`` ended by a :class:`Crash` at its ``checks``-th token
    boundary check (or earlier, by a Crash a test planted), then its session abandoned."""
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        if calls["n"] == checks:
            raise Crash()
        return False

    with pytest.raises(Crash):
        conv.respond(messages, max_new, should_stop=stop)
    conv.session.abandon()
