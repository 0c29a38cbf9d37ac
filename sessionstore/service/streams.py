"""The bridge between the engine thread and a request's coroutine: the engine pushes text pieces
and the outcome, the handler awaits them; a handler whose client vanished cancels the turn,
which ends at its next token boundary and commits."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    kind: str  # "text" | "done" | "error"
    value: Any


class TurnStream:
    """A :class:`TurnSink` feeding an asyncio queue on ``loop`` from another thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()

    def _put(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is gone (server stopped): nobody is listening
            self._cancelled.set()

    # ---- engine side ---------------------------------------------------------------------------
    def text(self, piece: str) -> None:
        self._put(Event("text", piece))

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def finish(self, outcome: Any) -> None:
        self._put(Event("done", outcome))

    def fail(self, exc: BaseException) -> None:
        self._put(Event("error", exc))

    # ---- handler side --------------------------------------------------------------------------
    async def next(self) -> Event:
        return await self._queue.get()

    def cancel(self) -> None:
        self._cancelled.set()


__all__ = ["Event", "TurnStream"]
