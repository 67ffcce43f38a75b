"""The HTTP connection `forerun serve` speaks: uvicorn's h11 protocol with a deadline for headers.

uvicorn closes a connection idle between requests, but not one that trickles its headers a byte
at a time (a slow client, or one holding connections open on purpose): each would hold its socket
forever. Here a connection has `header_timeout` seconds, from when it opens or its last response
ended, to send a whole request head; then it is closed. The body has its own deadline
(forerun/serve/requests.py `read_json`).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    header_timeout: float = 10.0  # seconds

    @classmethod
    def with_timeout(cls, seconds: float) -> type[TimedH11Protocol]:
        """The protocol with a head deadline of `seconds` (uvicorn takes a class)."""
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived whole
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.header_timeout, self._head_too_slow)

    def _disarm(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()
