"""Slow clients cannot hold the server's connections: header, body and per-client limits.

uvicorn has an idle keep-alive timeout and a global concurrency limit, but no limit on how long a
client may take to send its request headers or its body, and none per client. Here:

- ``GuardedH11Protocol`` (uvicorn's h11 protocol plus two checks): a connection must deliver
  complete request headers within ``header_timeout_s`` of opening (and of its previous response),
  else it is closed; one client address may hold at most ``max_connections_per_client``
  connections (extra ones are closed at once). Behind a reverse proxy every client shares the
  proxy's address: raise the limit (or 0 = off) and let the proxy enforce its own (README).
- ``BodyReadTimeoutMiddleware`` (ASGI): each read of the body must bring data within
  ``body_read_timeout_s``, and after that grace period the body must average at least
  ``body_min_rate_bytes_s``; otherwise the request ends with 408 (an upload's temp file is removed
  by the store, as for any aborted upload). Once the server is stopping (SIGTERM), a body still
  arriving is abandoned shortly before the grace period ends, with a 503 and ``Retry-After``,
  rather than cancelled by uvicorn mid-read (a 500 and a traceback).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import anyio
import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from stepdoctor_server.core.errors import ApiError


class BodyTimeout(ApiError):
    """The client sent its body too slowly (408)."""

    def __init__(self, message: str) -> None:
        super().__init__(408, "request_timeout", message, headers={"Connection": "close"})


class ShuttingDown(ApiError):
    """The server stopped while the body was still arriving (503: the client retries elsewhere or later)."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "shutting_down",
            "the server is shutting down; send the request again",
            headers={"Retry-After": "5", "Connection": "close"},
        )


# A body read wakes this often to see whether the server is stopping (a cancelled read loses
# nothing: uvicorn hands the body over only when the wait returns).
_STOP_POLL_S = 0.25
_ANSWER_MARGIN_S = 0.5  # a body read gives up this long before the grace period ends, to answer


class BodyReadTimeoutMiddleware:
    """Wraps ``receive`` so a body that stalls, or trickles below a minimum rate, ends in 408, and
    one still arriving when the server stops ends in 503 within the grace period.

    ``stopping_at()`` gives the monotonic time the grace period ends once the server is stopping
    (``app.begin_shutdown``), else None.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        read_timeout_s: float,
        min_rate_bytes_s: float,
        stopping_at: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.app = app
        self.read_timeout_s = read_timeout_s
        self.min_rate = min_rate_bytes_s
        self.stopping_at = stopping_at

    async def _receive_within(self, receive: Receive, timeout_s: float) -> Message:
        """``receive()`` within ``timeout_s`` (TimeoutError), or ShuttingDown shortly before the
        grace period ends, leaving time to answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            stop = self.stopping_at()
            if stop is not None and now >= stop - _ANSWER_MARGIN_S:
                raise ShuttingDown()
            if now >= deadline:
                raise TimeoutError
            with anyio.move_on_after(min(_STOP_POLL_S, deadline - now)):
                return await receive()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.read_timeout_s <= 0:
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        received = 0
        body_done = False  # afterwards receive() only waits for a disconnect (streamed responses)

        async def timed_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await self._receive_within(receive, self.read_timeout_s)
            except TimeoutError:
                raise BodyTimeout(
                    f"no request body data for {self.read_timeout_s:g} s; request abandoned"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                elapsed = time.monotonic() - started
                if (
                    message.get("more_body", False)
                    and self.min_rate > 0
                    and elapsed > self.read_timeout_s
                    and received < self.min_rate * elapsed
                ):
                    raise BodyTimeout(
                        f"request body arrives at {received / elapsed:.0f} B/s, under the minimum "
                        f"{self.min_rate:g} B/s; request abandoned"
                    )
            return message

        await self.app(scope, timed_receive, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-header deadline and a per-client connection cap.

    Configured through class attributes (``configure``), since uvicorn instantiates the class.
    """

    header_timeout_s: ClassVar[float] = 10.0
    max_connections_per_client: ClassVar[int] = 0
    _per_client: ClassVar[Counter[str]] = Counter()

    @classmethod
    def configure(
        cls, *, header_timeout_s: float, max_connections_per_client: int
    ) -> type[GuardedH11Protocol]:
        """A subclass with these limits and its own per-client counts."""
        return type(
            "GuardedH11Protocol",
            (cls,),
            {
                "header_timeout_s": header_timeout_s,
                "max_connections_per_client": max_connections_per_client,
                "_per_client": Counter(),
            },
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._counted: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else None
        if host is not None and self.max_connections_per_client > 0:
            self._per_client[host] += 1
            self._counted = host
            if self._per_client[host] > self.max_connections_per_client:
                self.logger.warning("closing connection: %s holds too many connections", host)
                transport.close()
                return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._counted is not None:
            self._per_client[self._counted] -= 1
            if self._per_client[self._counted] <= 0:
                del self._per_client[self._counted]
            self._counted = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers get the same deadline

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        if self.header_timeout_s > 0:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        """Close the connection unless a request's headers arrived since the timer was armed."""
        self._header_timer = None
        if self.conn.their_state in (h11.IDLE,) and not self.transport.is_closing():
            self.logger.info(
                "closing connection: request headers not complete in %g s", self.header_timeout_s
            )
            self.transport.close()


def uvicorn_options(settings: Any) -> dict[str, Any]:
    """The uvicorn.run keyword arguments that enforce these limits (from Settings)."""
    protocol = GuardedH11Protocol.configure(
        header_timeout_s=settings.header_timeout_s,
        max_connections_per_client=settings.max_connections_per_client,
    )
    return {
        "http": protocol,
        "timeout_keep_alive": 5,
        # In-flight requests get this long after SIGTERM, then are cancelled (see cli.serve).
        "timeout_graceful_shutdown": settings.shutdown_grace_s,
        # h11 refuses request heads larger than this (431), so headers cannot grow memory either.
        "h11_max_incomplete_event_size": 64 * 1024,
    }
