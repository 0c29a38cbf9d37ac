"""A turn's events as the API process's handlers read them: :class:`Event` (a piece of text, the
outcome or an error, as :class:`~sessionstore.service.http.core_client.CoreClient` routes them
from the engine core) and :func:`merged`, the events of several turns (``n > 1``) as they come."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

S = TypeVar("S")  # a turn's stream, as ``receive`` reads it


@dataclass(frozen=True)
class Event:
    kind: str  # "text" | "done" | "error"
    value: Any
    logprobs: Any = None  # "text": the log-probabilities of the tokens drawn since the last piece (or None)


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


__all__ = ["Event", "merged"]
