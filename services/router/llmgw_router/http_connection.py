"""One client connection of the router's HTTP/1.1 server: httptools' parser, the requests, the answers.

Requests are parsed as bytes arrive; each request's handler runs as its own task from the moment its
headers are complete (its body may still be coming: ``Request.read()`` waits), one at a time per
connection, in order (pipelined requests wait their turn, parsed, with their bodies). A connection
that ends, or that the client half-closes, cancels its running handler, which is how the upstream
request and the engine's work are stopped when a client hangs up.

A response that ends while its request's body is still coming (a 413 or 401 before the body, a 408)
says ``Connection: close``; the rest of the body is read and dropped for up to ``LINGER_S`` before the
connection closes, so the client can read the answer instead of getting a reset.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, cast
from urllib.parse import unquote

import httptools

from llmgw_router.errors import error_body
from llmgw_router.web import RelayedResponse, Request, Response, status_line

if TYPE_CHECKING:
    from llmgw_router.http_server import HttpServer

log = logging.getLogger("llmgw.router.http")

# A request's line and headers together: more is refused (431) before it can grow in memory.
MAX_HEAD_BYTES = 64 * 1024
# Parsed requests waiting behind the one being handled; more and the connection stops reading.
MAX_PIPELINE = 16
# After a response that ends before its request's body did: read and drop the rest this long.
LINGER_S = 5.0
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_WHOLE = frozenset((Response, RelayedResponse))
# Headers that say where a request's body ends (to read on past an Upgrade header: below).
_FRAMING = frozenset((b"content-length", b"transfer-encoding"))


def error_head(status: int, message: str) -> bytes:
    body = error_body(status, message)
    return (
        status_line(status)
        + b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )


class Connection(asyncio.Protocol):
    """One client connection: parser, the requests on it, the flow of the answers back."""

    __slots__ = (
        "_body_target",
        "_drain",
        "_head_bytes",
        "_headers",
        "_linger_until",
        "_parsing",
        "_pipeline",
        "_synthetic",
        "_task",
        "_trailing",
        "_url",
        "admitted",
        "closing",
        "deadline",
        "idle_since",
        "loop",
        "lost",
        "parser",
        "reading_paused",
        "server",
        "since",
        "transport",
        "write_paused_at",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.admitted = False
        # Loop time by which the request line and headers must be complete (None: not waiting for them).
        self.deadline: float | None = None
        self.since = 0.0
        # Loop time the last answer ended with nothing else to do (None: a request is on its way).
        self.idle_since: float | None = None
        # Loop time the transport paused writing (its buffer full: the client is not reading), or None.
        self.write_paused_at: float | None = None
        self.closing = False
        self.lost = False
        self.reading_paused = False
        self._linger_until: float | None = None
        self._drain: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pipeline: collections.deque[Request] = collections.deque()
        # The request being parsed (its body goes to it), and its line and headers so far.
        self._parsing: Request | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        # Reading a body on past an Upgrade header: the synthetic head's callbacks are not a request.
        self._synthetic = False
        self._body_target: Request | None = None
        # Past a head, the parser's header callback brings a chunked body's trailers: not headers (a
        # key sent there would pass where a proxy in front never looks).
        self._trailing = False

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
        self.since = self.loop.time()
        self.deadline = self.since + self.server.guard.header_timeout_s

    def data_received(self, data: bytes) -> None:
        if self.closing:
            if self._linger_until is None:
                return
        if self.deadline is not None:
            self._head_bytes += len(data)
        while True:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as e:
                # httptools stops at any Upgrade header (or CONNECT) and takes what follows the headers
                # for another protocol; the router speaks none, so the request is served as plain
                # HTTP/1.1 (curl --http2 asks for h2c on every http:// request). Its body was skipped:
                # read it with a parser told this request's framing, then go on with the next request.
                offset = e.args[0] if e.args and isinstance(e.args[0], int) else len(data)
                data = data[offset:]
                self.parser = httptools.HttpRequestParser(self)
                req = self._body_target
                framing = [k + b": " + v + b"\r\n" for k, v in self._headers if k.lower() in _FRAMING]
                if req is not None and framing:
                    req.complete = False
                    self._synthetic = True
                    data = b"POST / HTTP/1.1\r\n" + b"".join(framing) + b"\r\n" + data
                continue
            except httptools.HttpParserError as e:
                self._bad_request(400, f"malformed HTTP request: {e}")
                return
            break
        if self.deadline is not None and self._head_bytes > MAX_HEAD_BYTES:
            self._bad_request(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")
        elif len(self._pipeline) >= MAX_PIPELINE:
            self._pause_reading()

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

    def resume_writing(self) -> None:
        self.write_paused_at = None
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    # ------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if self._synthetic:
            return
        self._url = b""
        self._headers = []
        self._trailing = False
        self.idle_since = None
        if self.deadline is None:
            self.since = self.loop.time()
            self.deadline = self.since + self.server.guard.header_timeout_s
            self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        if not self._synthetic:
            self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._synthetic or self._trailing:
            return
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._synthetic or self.closing:
            # Not a request to serve: the head of the body parser past an Upgrade, or a request that
            # follows one answered with "Connection: close" (the connection ends after that answer).
            return
        self.deadline = None
        self._head_bytes = 0
        self._trailing = True
        p = self.parser
        raw = self._url
        q = raw.find(b"?")
        raw_path, query = (raw, b"") if q < 0 else (raw[:q], raw[q + 1 :])
        try:
            path = raw_path.decode("ascii")
            if "%" in path:
                path = unquote(path, errors="strict")
        except UnicodeDecodeError:
            path = "\0"  # not a path any route or exemption has: 404 after the key check
        req = Request(
            self,
            p.get_method().decode("ascii", "replace"),
            path,
            query.decode("latin-1"),
            self._headers,
            p.get_http_version(),
            p.should_keep_alive(),
        )
        self._parsing = self._body_target = req
        if self._task is None and not self._pipeline:
            self._start(req)
        else:
            self._pipeline.append(req)

    def on_body(self, body: bytes) -> None:
        req = self._body_target
        if req is not None:
            req._feed(body, self.server.max_body_bytes)

    def on_message_complete(self) -> None:
        self._synthetic = False
        req = self._body_target
        self._parsing = None
        if req is not None:
            req._complete()
        if self._linger_until is not None:
            # The body of a request already answered with "Connection: close" is in: close now.
            self._close_transport()

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
                # Read and drop the rest of its body for a while, so the client can read the answer.
                self.closing = True
                self._linger_until = self.loop.time() + LINGER_S
                return
            self._close_transport()
            return
        if self._pipeline:
            nxt = self._pipeline.popleft()
            if self.reading_paused and not self.closing and self.transport is not None:
                self.reading_paused = False
                self.transport.resume_reading()
            self._start(nxt)
            return
        self.idle_since = self.since = self.loop.time()
        self.server.idle_changed()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

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

    def _bad_request(self, status: int, message: str) -> None:
        """Bytes that are not HTTP: answer if no answer is under way, then close; one DEBUG line."""
        log.debug("closing a client connection: %s (%d)", message, status)
        self.deadline = None
        busy = self._task is not None or self._pipeline
        self.closing = True
        self._linger_until = None
        t = self.transport
        if t is None:
            return
        if busy:
            self._pause_reading()  # the answer under way ends the connection (closing is set)
            return
        t.write(error_head(status, message))
        t.close()

    # ------------------------------------------------------------ state the guard reads

    def idle(self) -> bool:
        """No request on it: none begun (or its headers still coming), or between keep-alive requests."""
        return self.deadline is not None or (self._task is None and not self._pipeline)

    def lingered_out(self, now: float) -> bool:
        return self._linger_until is not None and now >= self._linger_until

    def _close_transport(self) -> None:
        self._linger_until = None
        self.closing = True
        if self.transport is not None:
            self.transport.close()

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

    def abort(self) -> None:
        """Close without flushing: close() would wait for a client that reads nothing, for ever."""
        self.closing = True
        if self.transport is not None:
            self.transport.abort()
