"""Read timeouts for slow clients: uvicorn's HTTP protocol (httptools) with a timer per connection.

A connection must send a request's headers within ``HEADER_TIMEOUT_S`` of connecting (or of the
first byte of its next request), and while its body arrives no gap between pieces may pass
``BODY_IDLE_TIMEOUT_S``; past either, the connection is closed (the handler reading the body sees
the client gone). A JSON body must also arrive whole within ``BODY_READ_TIMEOUT_S`` (a 408 from
the handler, :meth:`sessionstore.service.http.app.Api.body`), so a client trickling a byte a second is
cut; a bundle upload (gigabytes, legitimately slow) is bound by the idle gap only. Other clients
are unaffected: each timer is its connection's.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 30.0  # connect (or a keep-alive request's first byte) -> the headers' end
BODY_IDLE_TIMEOUT_S = 30.0  # the longest silence while a body arrives
BODY_READ_TIMEOUT_S = 30.0  # a JSON body, whole


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout and a body idle timeout."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_idle_timeout_s = BODY_IDLE_TIMEOUT_S

    _guard: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._guard = self.loop.call_later(seconds, self._cut)

    def _disarm(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None

    def _cut(self) -> None:
        """Too slow: close the connection (a handler reading its body sees it gone)."""
        self._guard = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._arm(self.body_idle_timeout_s)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._arm(self.body_idle_timeout_s)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_protocol(timeout_s: float) -> type[GuardedHttpProtocol]:
    """:class:`GuardedHttpProtocol` with both timeouts ``timeout_s`` (``--read-timeout``)."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,),
                {"header_timeout_s": timeout_s, "body_idle_timeout_s": timeout_s})


__all__ = ["BODY_IDLE_TIMEOUT_S", "BODY_READ_TIMEOUT_S", "GuardedHttpProtocol", "HEADER_TIMEOUT_S",
           "guarded_protocol"]
