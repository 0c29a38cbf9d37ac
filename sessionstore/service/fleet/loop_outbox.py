"""Items for queues on an asyncio event loop, put from other threads, one wake-up of the loop per
burst: a bundle export's chunks (:mod:`sessionstore.service.fleet.bundle_export`), written by the
exporting thread, reach the handler streaming them through it."""
from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any, TypeVar

T = TypeVar("T")


class LoopOutbox:
    """Events for queues on one event loop, put from other threads: the first event of a burst
    schedules one drain on the loop; the others join it. Each queue's events keep their order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._scheduled = False
        self.drains = 0  # drains run on the loop so far: one per burst of puts, not one per put

    def put(self, queue: asyncio.Queue[T], event: T) -> bool:
        """Queue ``event`` (an export's chunk) for ``queue``; False once
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
        self.drains += 1
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


__all__ = ["LoopOutbox", "outbox_of"]
