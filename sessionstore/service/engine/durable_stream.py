"""``serve --durable-stream``: a turn on a session in durable-stream mode streams through a
:class:`sessionstore.sessions.durable_text.HeldText`, so each piece of its text reaches the
client only once the commit covering its token has returned."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kernels.model.logits import TokenLogprob
from sessionstore.sessions import Session, held_until_committed


class HeldSink:
    """A turn sink whose text goes to ``hold`` (the client's sink asked whether it still listens)."""

    def __init__(self, hold: Callable[..., None], sink: Any) -> None:
        self._hold, self._sink = hold, sink

    def text(self, piece: str, logprobs: list[TokenLogprob] | None = None) -> None:
        self._hold(piece, logprobs)

    def cancelled(self) -> bool:
        return bool(self._sink.cancelled())


@contextmanager
def durable_sink(session: Session, sink: Any) -> Iterator[Any]:
    """The sink a turn on ``session`` writes to: ``sink`` itself, or, in durable-stream mode, one
    whose pieces are sent as the session's commits return (:func:`held_until_committed`)."""
    with held_until_committed(session, sink.text) as emit:
        yield HeldSink(emit, sink) if session.options.durable_stream else sink


__all__ = ["HeldSink", "durable_sink"]
