"""One client connection of the router's HTTP/1.1 server: httptools' parser, the limits on what a
client may send, the requests, the answers.

Requests are parsed as bytes arrive; each request's handler runs as its own task from the moment its
headers are complete (its body may still be coming: ``Request.read()`` waits), one at a time per
connection, in order (pipelined requests wait their turn, parsed, reading paused while they wait). A
connection that ends, or that the client half-closes, cancels its running handler, which is how the
upstream request and the engine's work are stopped when a client hangs up.

What one connection can make the router hold is bounded here (the router README says how much):

- a request's line and headers: ``MAX_HEAD_BYTES``, counted by reads while a head is incomplete (so
  httptools never gathers more of an unfinished field) and measured exactly when a head came whole
  in one read;
- a chunked body's trailer section: ``MAX_TRAILER_BYTES``, counted by reads (httptools joins a
  field's pieces with a copy per read, which is quadratic in the field's size);
- requests waiting behind the one being handled: reading pauses while any waits, so a waiting request
  has no more of its body than the read that brought it; a read that brings more than
  ``MAX_PIPELINE`` ends the connection after their answers (a pipelining client sends the rest again).

A request refused (431, 400, 505) is answered when the answers before it are out, then the connection
ends gently: what the client still sends is read and dropped for up to ``LINGER_S``, because a close
with unread bytes makes the kernel reset the connection, and the client could lose its answer. So does
a response that ends while its request's body is still coming (a 413 or 401 before the body, a 408):
it says ``Connection: close``, and the rest of the body is read and dropped before the close.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, cast
from urllib.parse import unquote

import httptools

from llmgw_router.http.guard import ConnectionGuard
from llmgw_router.http.request import Request
from llmgw_router.http.response import RelayedResponse, Response, StreamResponse, status_line

# The body of an error the server answers itself (a request that is not HTTP, over a limit, a handler
# that failed), given the status and what is wrong: the application's error shape, passed in.
ErrorBody = Callable[[int, str], bytes]


class _DateHeader(Protocol):
    @property
    def header(self) -> bytes: ...


class ConnectionServer(Protocol):
    """What a connection asks of its server (:class:`llmgw_router.http.server.HttpServer`), named here by
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
    def error_body(self) -> ErrorBody: ...

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


log = logging.getLogger("llmgw.router.http")

# A request's line and headers together: more is refused (431) before it can grow in memory.
MAX_HEAD_BYTES = 64 * 1024
# Parsed requests waiting behind the one being handled (see the module's docstring).
MAX_PIPELINE = 16
# A chunked body's trailer section: more is refused (431).
MAX_TRAILER_BYTES = 64 * 1024
# After an answer that ends the connection before the client stopped sending: read and drop this long.
LINGER_S = 5.0
# Headers that say where a request's body ends (to read on past an Upgrade header: below).
_FRAMING = frozenset((b"content-length", b"transfer-encoding"))
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_WHOLE = frozenset((Response, RelayedResponse))


def plain_error_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "code": status}}).encode()


def error_head(status: int, body: bytes) -> bytes:
    return (
        status_line(status)
        + b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )


class _Stop(Exception):
    """Raised in a parser callback to stop the parse of a read (what stopped it is on the connection)."""


class Connection(asyncio.Protocol):
    """One client connection: parser, the requests on it, the flow of the answers back."""

    __slots__ = (
        "_body_target",
        "_drain",
        "_dropping",
        "_head_bytes",
        "_headers",
        "_linger_until",
        "_parsing",
        "_pipeline",
        "_read_len",
        "_refusal",
        "_stopped",
        "_synthetic",
        "_task",
        "_trailer",
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
        "trust_forwarded",
        "write_paused_at",
    )

    def __init__(self, server: ConnectionServer) -> None:
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
        # Whether the client is a trusted proxy (its X-Forwarded-* headers are believed): request.Request.headers.
        self.trust_forwarded = False
        self.closing = False
        self.lost = False
        self.reading_paused = False
        self._linger_until: float | None = None
        # Lingering with the parse over: what comes is dropped unread.
        self._dropping = False
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
        # Bytes of the reads that began after a chunk's size line with none of its data yet: a
        # trailer section's (or a chunk's data yet to come); -1: not there.
        self._trailer = -1
        # The length of the read being parsed (the head limit's check when a whole head came in one).
        self._read_len = 0
        # The parse is over (a refusal, or a read that brought more than MAX_PIPELINE): no more reading.
        self._stopped = False
        # The answer owed to the request the parse stopped at: (status, message).
        self._refusal: tuple[int, str] | None = None

    # ------------------------------------------------------------ asyncio.Protocol

    def data_received(self, data: bytes) -> None:
        if self.closing:
            if self._linger_until is None or self._dropping:
                return
        n = self._read_len = len(data)
        if self.deadline is not None:
            self._head_bytes += n
        if self._trailer >= 0:
            self._trailer += n
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
                refusal = self._refusal
                if refusal is not None:
                    self._bad_request(*refusal)
                elif self._stopped:  # a full pipeline: its answers, then the end
                    self._pause_reading()
                else:
                    self._bad_request(400, f"malformed HTTP request: {e}")
                return
            break
        if self.deadline is not None and self._head_bytes > MAX_HEAD_BYTES:
            self._bad_request(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")
        elif self._trailer > MAX_TRAILER_BYTES:
            self._bad_request(431, f"trailer fields over {MAX_TRAILER_BYTES} bytes")
        elif self._pipeline:
            self._pause_reading()

    # ------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if self._synthetic:
            return
        self._url = b""
        self._headers = []
        self._trailing = False
        self._trailer = -1
        self.idle_since = None
        if self.deadline is None:
            # ``since`` stays when the connection became idle: the guard's order of eviction.
            self.deadline = self.loop.time() + self.server.guard.header_timeout_s
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
        if self._head_bytes + self._read_len > MAX_HEAD_BYTES:
            # Counted by reads, a head that came whole in one read was never checked: its exact size.
            size = len(self._url) + sum(len(k) + len(v) + 4 for k, v in self._headers)
            if size > MAX_HEAD_BYTES:
                self._stop(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")
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
        version = p.get_http_version()
        if version != "1.1" and version != "1.0":
            # llhttp reads any digit.digit (HTTP/2.0, 0.9): an HTTP/1.x server serves only those.
            self._stop(505, f"HTTP/{version} is not served here (HTTP/1.1 or 1.0)")
        req = Request(
            self,
            p.get_method().decode("ascii", "replace"),
            path,
            query.decode("latin-1"),
            self._headers,
            version,
            p.should_keep_alive(),
        )
        if req.problem is not None:
            self._stop(*req.problem)
        if self._task is None and not self._pipeline:
            self._start(req)
        elif len(self._pipeline) < MAX_PIPELINE:
            self._pipeline.append(req)
        else:
            # More in one read than may wait: this one and the rest of the read are not served; the
            # last one waiting ends the connection (a pipelining client sends the rest again).
            self._stopped = True
            self._pipeline[-1].keep_alive = False
            raise _Stop()
        self._parsing = self._body_target = req

    def on_body(self, body: bytes) -> None:
        self._trailer = -1
        req = self._body_target
        if req is not None:
            req.feed(body, self.server.max_body_bytes)

    def on_chunk_header(self) -> None:
        # A chunk's size line: what follows is its data, or (the last chunk's) the trailer section.
        self._trailer = 0

    def on_chunk_complete(self) -> None:
        self._trailer = -1

    def on_message_complete(self) -> None:
        self._synthetic = False
        req = self._body_target
        self._parsing = None
        if req is not None:
            req.end_body()
        if self._linger_until is not None:
            # The body of a request already answered with "Connection: close" is in: close now.
            self._close_transport()

    # ------------------------------------------------------------ stopping

    def _stop(self, status: int, message: str) -> None:
        """Stop the parse in a callback: data_received refuses the request with ``status``."""
        self._refusal = (status, message)
        raise _Stop()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def _bad_request(self, status: int, message: str) -> None:
        """Bytes that are not HTTP, or over a limit: answered once the answers before it are out, then
        the connection ends; one DEBUG line."""
        log.debug("closing a client connection: %s (%d)", message, status)
        self.deadline = None
        self._stopped = True
        t = self.transport
        if t is None:
            return
        if self._linger_until is not None:
            # Answered already (its answer said "Connection: close"): drop the rest, then end.
            self._end_gently()
            return
        if self._task is not None or self._pipeline:
            req = self._body_target
            if req is not None and not req.complete and not self._pipeline:
                # The request being handled will not get the rest of its body: end it now rather than
                # let its handler wait out the body timeout.
                self.abort()
                return
            # Answered after the answers under way (Connection.send_refusal).
            self._refusal = (status, message)
            self._pause_reading()
            return
        self.closing = True
        t.write(self._error_head(status, message))
        self._end_gently()

    def _error_head(self, status: int, message: str) -> bytes:
        return error_head(status, self.server.error_body(status, message))

    def send_refusal(self) -> bool:
        """The answer owed to a request the parse stopped at, if any, then the end; whether there was one."""
        refusal = self._refusal
        if refusal is None:
            return False
        self._refusal = None
        self.closing = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self._error_head(*refusal))
        self._end_gently()
        return True

    def _end_gently(self, for_s: float = LINGER_S) -> None:
        """End the connection after what was written, reading and dropping what the client still sends
        for up to ``for_s`` (the sweep closes it then; the client's own close ends it sooner)."""
        self.closing = self._dropping = True
        self._linger_until = self.loop.time() + for_s
        t = self.transport
        if t is None or t.is_closing():
            return
        if self.reading_paused:
            self.reading_paused = False
            t.resume_reading()
        if t.can_write_eof():
            t.write_eof()
        else:
            t.close()

    def _close_transport(self) -> None:
        self._linger_until = None
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close without flushing: close() would wait for a client that reads nothing, for ever."""
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    @property
    def max_body_bytes(self) -> int:
        return self.server.max_body_bytes

    @property
    def date_header(self) -> bytes:
        return self.server.clock.header

    # ------------------------------------------------------------ asyncio.Protocol: the connection's life

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
        # The client hung up: its handler is cancelled, which closes its upstream request.
        self.stop_handler()
        self._pipeline.clear()
        d = self._drain
        if d is not None and not d.done():
            d.set_exception(ConnectionResetError("the client has gone"))
        for req in (self._parsing, self._body_target):
            if req is not None:
                req.wake()
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
                    status=500,
                    body=self.server.error_body(500, "internal error"),
                    content_type="application/json",
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

    def stop_handler(self) -> None:
        """Cancel the handler under way, if any. Not only once (the server's finisher cancels again
        until it ends): see :meth:`HttpServer.end_handler`."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            self.server.end_handler(task)

    # ------------------------------------------------------------ state the server and the guard read

    def busy(self) -> bool:
        """A request is being handled on it, or waits its turn."""
        return self._task is not None or bool(self._pipeline)

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
