"""Which sessions are resident (lock held, rows mapped), least recently used first, and the
memory budget that bounds them: when the resident ones exceed ``budget`` bytes, the least
recently used are suspended (disk only) until they fit.

A session reports itself here (``register`` when it becomes resident, ``touch`` when it is used,
``unregister`` when it is released); the store owns one :class:`Residency` and hands it to
every session it opens.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from sessionstore.log import get_logger

log = get_logger("store")


class Resident(Protocol):
    """What the budget needs of a session."""

    @property
    def id(self) -> str: ...
    def memory_bytes(self) -> int: ...
    def suspend(self) -> None: ...


R = TypeVar("R", bound=Resident)


class Residency(Generic[R]):
    """The resident sessions in least-recently-used order, bounded by ``budget`` bytes (None:
    no bound). Thread-safe; a session is suspended outside the lock."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self._resident: OrderedDict[int, R] = OrderedDict()
        self._lock = threading.RLock()

    def register(self, session: R) -> None:
        """``session`` became resident: the most recently used now."""
        with self._lock:
            self._resident[id(session)] = session
            self._resident.move_to_end(id(session))

    def unregister(self, session: R) -> None:
        """``session`` was released (suspended, abandoned or closed)."""
        with self._lock:
            self._resident.pop(id(session), None)

    def touch(self, session: R) -> None:
        """``session`` is in use: the most recently used; then the budget is enforced around it."""
        with self._lock:
            if id(session) in self._resident:
                self._resident.move_to_end(id(session))
        self.enforce_budget(keep=session)

    def sessions(self) -> list[R]:
        """Resident sessions, least recently used first."""
        with self._lock:
            return list(self._resident.values())

    def resident_bytes(self) -> int:
        return sum(s.memory_bytes() for s in self.sessions())

    def enforce_budget(self, keep: R | None = None) -> list[str]:
        """Suspend least recently used sessions (never ``keep``) until the resident ones fit."""
        if self.budget is None:
            return []
        suspended = []
        for session in self.sessions():
            if self.resident_bytes() <= self.budget:
                break
            if session is keep:
                continue
            session.suspend()
            suspended.append(session.id)
            log.info("session.evict", id=session.id, budget=self.budget)
        return suspended


__all__ = ["Resident", "Residency"]
