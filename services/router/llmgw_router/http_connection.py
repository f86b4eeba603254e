"""One client connection of the router's HTTP/1.1 server: the requests, the answers.

Requests are parsed as bytes arrive (``http_reading.RequestReader``: the parser and the limits); each request's handler runs as its own task from the moment its
headers are complete (its body may still be coming: ``Request.read()`` waits), one at a time per
connection, in order (pipelined requests wait their turn, parsed, reading paused while they wait). A connection
that ends, or that the client half-closes, cancels its running handler, which is how the upstream
request and the engine's work are stopped when a client hangs up.

A response that ends while its request's body is still coming (a 413 or 401 before the body, a 408)
says ``Connection: close``; the rest of the body is read and dropped for up to ``LINGER_S`` before the
connection closes, so the client can read the answer instead of getting a reset.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, cast

from llmgw_router.connections import ConnectionGuard
from llmgw_router.errors import error_body
from llmgw_router.http_reading import (
    LINGER_S,
    MAX_HEAD_BYTES,
    MAX_PIPELINE,
    MAX_TRAILER_BYTES,
    RequestReader,
    error_head,
)
from llmgw_router.http_request import Request
from llmgw_router.http_response import RelayedResponse, Response, StreamResponse

log = logging.getLogger("llmgw.router.http")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_WHOLE = frozenset((Response, RelayedResponse))

__all__ = ["LINGER_S", "MAX_HEAD_BYTES", "MAX_PIPELINE", "MAX_TRAILER_BYTES", "Connection", "error_head"]


class _DateHeader(Protocol):
    @property
    def header(self) -> bytes: ...


class ConnectionServer(Protocol):
    """What a connection asks of its server (:class:`llmgw_router.http_server.HttpServer`), named here by
    use: the server imports this module."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def guard(self) -> ConnectionGuard: ...

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def clock(self) -> _DateHeader: ...

    @property
    def refused(self) -> bytes: ...

    @property
    def trusted_proxies(self) -> Sequence[object]: ...

    @property
    def connections(self) -> set[Connection]: ...

    @property
    def draining(self) -> bool: ...

    @property
    def handler(self) -> Callable[[Request], Awaitable[StreamResponse]]: ...

    def trusts(self, peer: object) -> bool: ...

    def end_handler(self, handler: asyncio.Task[None]) -> None: ...

    def idle_changed(self) -> None: ...


class Connection(RequestReader):
    """One client connection: parser, the requests on it, the flow of the answers back."""

    __slots__ = ()
    server: ConnectionServer

    def __init__(self, server: ConnectionServer) -> None:
        super().__init__(server)

    @property
    def max_body_bytes(self) -> int:
        return self.server.max_body_bytes

    @property
    def date_header(self) -> bytes:
        return self.server.clock.header

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        if not self.server.guard.admit(self):
            self.transport.write(self.server.refused)
            self.transport.close()
            return
        self.admitted = True
        if self.server.trusted_proxies:
            self.trust_forwarded = self.server.trusts(self.transport.get_extra_info("peername"))
        self.since = self.loop.time()
        self.deadline = self.since + self.server.guard.header_timeout_s
        self.server.guard.became_idle(self)

    def eof_received(self) -> bool | None:
        # A client that closes its side has gone (as aiohttp.web treats it): the transport closes, and
        # connection_lost cancels the handler, so its engine stops generating for nobody.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = self.lost = True
        self._linger_until = None
        if self.admitted:
            self.admitted = False
            self.server.guard.forget(self)
        if self._task is not None and not self._task.done():
            # The client hung up: its handler is cancelled, which closes its upstream request. Not
            # only once (the server's finisher cancels again until it ends): see HttpServer.end_handler.
            self._task.cancel()
            self.server.end_handler(self._task)
        self._pipeline.clear()
        d = self._drain
        if d is not None and not d.done():
            d.set_exception(ConnectionResetError("the client has gone"))
        for req in (self._parsing, self._body_target):
            if req is not None:
                req._wake()
        self.server.connections.discard(self)

    def pause_writing(self) -> None:
        self.write_paused_at = self.loop.time()
        if self.admitted:
            self.server.guard.stalled(self)

    def resume_writing(self) -> None:
        self.write_paused_at = None
        self.server.guard.unstalled(self)
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    # ------------------------------------------------------------ handling

    def _start(self, req: Request) -> None:
        self.idle_since = None
        self._task = self.loop.create_task(self._handle(req))

    async def _handle(self, req: Request) -> None:
        try:
            try:
                resp = await self.server.handler(req)
            except (asyncio.CancelledError, ConnectionResetError):
                raise
            except Exception:
                log.exception("handler failed for %s %s", req.method, req.path)
                resp = Response(
                    status=500, body=error_body(500, "internal error"), content_type="application/json"
                )
            if type(resp) in _WHOLE and not resp.prepared:
                # A whole answer: head and body made at once and sent in one write (prepare, then
                # write_eof, would make the same bytes in three coroutines). Not for a subclass: it
                # may have its own prepare or write_eof.
                await self.send(cast(Response, resp).whole(req))
            else:
                if not resp.prepared:
                    await resp.prepare(req)
                await resp.write_eof()
            close = resp.will_close
        except (ConnectionResetError, asyncio.CancelledError):
            self._task = None
            self.abort()
            return
        except Exception:
            # Whatever failed while sending, the connection must not stay with a finished task and
            # requests queued behind it (its client would wait for ever): drop it.
            log.exception("sending the answer to %s %s failed", req.method, req.path)
            self._task = None
            self.abort()
            return
        self._task = None
        self._done(req, close)

    def _done(self, req: Request, close: bool) -> None:
        """An answer is out: the next request, or keep-alive, or close."""
        if close or self.closing or not req.keep_alive or self.server.draining:
            if not req.complete and self.transport is not None and not self.transport.is_closing():
                # Read and drop the rest of its body for a while, so the client can read the answer
                # (dropped: not fed to the request, whose handler has ended).
                self.closing = True
                self._linger_until = self.loop.time() + LINGER_S
                self._body_target = None
                return
            if self.reading_paused:
                self._end_gently()  # bytes may be unread: a close now would reset the answer
            else:
                self._close_transport()
            return
        if self._pipeline:
            nxt = self._pipeline.popleft()
            if (
                not self._pipeline
                and self.reading_paused
                and not self._stopped
                and self.transport is not None
            ):
                # Nothing waits now: the body of the one started (if still coming) and what follows.
                self.reading_paused = False
                self.transport.resume_reading()
            self._start(nxt)
            return
        if self._refusal is not None and self.send_refusal():
            return
        self.idle_since = self.since = self.loop.time()
        self.server.guard.became_idle(self)
        self.server.idle_changed()

    def must_close(self, req: Request) -> bool:
        """Whether the answer to ``req`` ends the connection (said in its head)."""
        return self.closing or not req.keep_alive or not req.complete or self.server.draining

    def gone(self) -> bool:
        t = self.transport
        return t is None or t.is_closing()

    async def send(self, data: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("the client has gone")
        t.write(data)
        if self.write_paused_at is not None:
            d = self._drain = self.loop.create_future()
            try:
                await d
            finally:
                self._drain = None

    def write_continue(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_CONTINUE)

    # ------------------------------------------------------------ state the guard reads

    def idle(self) -> bool:
        """No request on it: none begun (or its headers still coming), or between keep-alive requests."""
        return self.deadline is not None or (self._task is None and not self._pipeline)

    def lingered_out(self, now: float) -> bool:
        return self._linger_until is not None and now >= self._linger_until

    def end_linger(self) -> None:
        """A linger's time is up. Reading its body's rest, it sends FIN first and drops what still comes
        for a second: closed at once with bytes arriving, the kernel would reset the connection, and
        the client could read the reset before the answer's end. Already past that: closed."""
        if self._dropping:
            self.close()
        else:
            self._end_gently(1.0)

    def close(self) -> None:
        """Close; abort if response bytes are still waiting to be sent.

        A graceful close waits for those bytes to leave, for ever if the client reads nothing (it
        pipelined a stream and half of its next request, then stopped reading); the guard has stopped
        counting the connection by then, so its descriptor would be held outside the cap for good.
        """
        self.closing = True
        if self.transport is not None:
            self.transport.close()
            if self.transport.get_write_buffer_size() > 0:
                self.transport.abort()
