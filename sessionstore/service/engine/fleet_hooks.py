"""What the engine asks of the fleet through a session's life (:class:`FleetHooks`: check a
session out before it opens, the options it opens with, keep its lease while resident, ship a turn,
check it in, forget it),
and :class:`NoFleet`, those hooks on a server without ``--remote``: every session is this host's
alone, so each hook does nothing. The engine holds one or the other from its construction."""
from __future__ import annotations

from typing import Protocol

from sessionstore.sessions import Session, SessionOptions


class FleetHooks(Protocol):
    """The part of :class:`~sessionstore.service.fleet.FleetHome` the engine calls."""

    def check_out(self, session_id: str, *, create: bool) -> bool: ...
    def session_options(self, session_id: str, options: SessionOptions) -> SessionOptions: ...
    def keep(self, session: Session) -> None: ...
    def turn_done(self, session_id: str) -> None: ...
    def check_in(self, session_id: str) -> None: ...
    def forget(self, session_id: str) -> bool: ...
    def close(self) -> None: ...


class NoFleet:
    """No fleet: nothing to pull, lease, ship or push back."""

    def check_out(self, session_id: str, *, create: bool) -> bool:
        """False: no newer copy is ever pulled over the local one."""
        return False

    def session_options(self, session_id: str, options: SessionOptions) -> SessionOptions:
        """``options`` as they are: nothing is shipped."""
        return options

    def keep(self, session: Session) -> None:
        pass

    def turn_done(self, session_id: str) -> None:
        pass

    def check_in(self, session_id: str) -> None:
        pass

    def forget(self, session_id: str) -> bool:
        """False: the fleet had nothing of it."""
        return False

    def close(self) -> None:
        pass


__all__ = ["FleetHooks", "NoFleet"]
