"""The bridge between the engine thread and a request's coroutine: the engine pushes text pieces
and the outcome, the handler awaits them; a handler whose client vanished cancels the turn,
which ends at its next token boundary and commits.

Events of every turn go to the loop through one :class:`LoopOutbox` per loop: a burst of events
(a batched decode step's tokens for every stream) wakes the loop once, not once per event."""
from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
S = TypeVar("S")  # a turn's stream, as ``receive`` reads it


@dataclass(frozen=True)
class Event:
    kind: str  # "text" | "done" | "error"
    value: Any
    logprobs: Any = None  # "text": the log-probabilities of the tokens drawn since the last piece (or None)


class LoopOutbox:
    """Events for queues on one event loop, put from other threads: the first event of a burst
    schedules one drain on the loop; the others join it. Each queue's events keep their order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._scheduled = False

    def put(self, queue: asyncio.Queue[T], event: T) -> bool:
        """Queue ``event`` (a turn's :class:`Event`, an export's chunk) for ``queue``; False once
        the loop is gone (nobody listens any more)."""
        if self._loop.is_closed():
            return False
        with self._lock:
            self._items.append((queue, event))
            if self._scheduled:
                return True
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed meanwhile
            return False
        return True

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, deque(), False
        for queue, event in items:
            queue.put_nowait(event)


_outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopOutbox] = weakref.WeakKeyDictionary()
_outboxes_lock = threading.Lock()


def outbox_of(loop: asyncio.AbstractEventLoop) -> LoopOutbox:
    """The one outbox of ``loop``."""
    with _outboxes_lock:
        box = _outboxes.get(loop)
        if box is None:
            box = _outboxes[loop] = LoopOutbox(loop)
        return box


class TurnStream:
    """A :class:`TurnSink` feeding an asyncio queue on ``loop`` from another thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._outbox = outbox_of(loop)
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()

    def _put(self, event: Event) -> None:
        if not self._outbox.put(self._queue, event):  # the loop is gone (server stopped): nobody listens
            self._cancelled.set()

    # ---- engine side ---------------------------------------------------------------------------
    def text(self, piece: str, logprobs: Any = None) -> None:
        self._put(Event("text", piece, logprobs))

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


async def merged(turns: list[tuple[S, Event]],
                 receive: Callable[[int, S], Awaitable[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """The events of several turns (each given with its first event) as they come, each with its
    turn's index, until every turn has given its last ("done" or "error"); ``receive(i, stream)``
    awaits turn i's next event. One turn is read directly (no task, no queue between)."""
    if len(turns) == 1:
        stream, event = turns[0]
        while True:
            yield 0, event
            if event.kind != "text":
                return
            event = await receive(0, stream)
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def pump(i: int, stream: S, event: Event) -> None:
        while True:
            queue.put_nowait((i, event))
            if event.kind != "text":
                return
            event = await receive(i, stream)

    tasks = [asyncio.create_task(pump(i, stream, first)) for i, (stream, first) in enumerate(turns)]
    try:
        left = len(turns)
        while left:
            i, event = await queue.get()
            left -= event.kind != "text"
            yield i, event
    finally:
        for task in tasks:
            task.cancel()


__all__ = ["Event", "LoopOutbox", "TurnStream", "merged", "outbox_of"]
