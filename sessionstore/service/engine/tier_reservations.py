"""The disk bytes a running turn may still write (FORMAT.md 5.10): a bound per session, held from
before the turn until the catalogue's row counts what the turn wrote."""
from __future__ import annotations

from collections.abc import Callable, Iterator


class Reservations:
    """Each running turn's bound on its session's files, and the ended turns' bounds kept until
    their rows catch up.

    A turn's last commit can still be on a commit thread when the turn ends, and until it returns
    the catalogue's row holds the size before the turn (or no row at all for a new session): a
    bound dropped at the turn's end let five 214 KB sessions onto a 1,000,000-byte disk. So an
    ended turn's bound is *settling*: it counts until ``listed_whole(session)`` says the row has
    caught up, and it never marks the session busy (an idle session may be offloaded)."""

    def __init__(self) -> None:
        self._bounds: dict[str, int] = {}  # session -> its files' size bound
        self._settling: set[str] = set()  # ended turns' sessions among them

    def hold(self, sid: str, bound: int) -> None:
        """A turn on ``sid`` starts: its files may grow to ``bound`` bytes."""
        self._bounds[sid] = bound
        self._settling.discard(sid)

    def end(self, sid: str) -> None:
        """The turn on ``sid`` ended: its bound settles."""
        if sid in self._bounds:
            self._settling.add(sid)

    def bound(self, sid: str) -> int | None:
        return self._bounds.get(sid)

    def running(self, sid: str) -> bool:
        """Whether a turn on ``sid`` holds its bound (not one settling)."""
        return sid in self._bounds and sid not in self._settling

    def items(self) -> Iterator[tuple[str, int]]:
        return iter(list(self._bounds.items()))

    def drop_stale(self, keep: str | None, idle: Callable[[str], bool], listed_whole: Callable[[str], bool]) -> None:
        """Drop each settled bound, and each running one whose turn never opened its session
        (``idle``: refused, no turn holds it any more); ``keep``'s stays."""
        for sid in [sid for sid in self._bounds if sid != keep]:
            if sid in self._settling:
                if listed_whole(sid):
                    del self._bounds[sid]
                    self._settling.discard(sid)
            elif idle(sid):
                del self._bounds[sid]


__all__ = ["Reservations"]
