"""Client connections: a cap on how many the router holds, and a deadline on each request's headers.

aiohttp.web closes a keep-alive connection after ``keepalive_timeout`` (the router's ``idle_timeout_s``)
but has no header timeout and no connection limit: a client that connects and sends half a request
line, or nothing, holds a file descriptor until the idle timeout, and 20,000 of them exhaust the
process's descriptors (then nobody is served, and the upstream side cannot connect either).

Every accepted connection is wrapped in :class:`_Guarded`, a thin protocol in front of aiohttp's that
feeds the bytes to httptools' request parser as well (a C parser; it only notes where each request's
headers begin and end) and passes everything on unchanged:

- **header deadline**: from the connection's start, and from the first byte of each later request,
  until its headers are complete. A sweep (a few times per timeout) closes connections past it.
- **write deadline**: a connection whose writes have waited for room (the transport paused writing:
  the client reads nothing) for ``write_timeout_s`` is closed, which ends its handler, its upstream
  request and the engine's work. aiohttp's drain has no deadline, and one per write would cost on
  every chunk of every stream; the pause and resume callbacks cost nothing until a client stalls.
- **cap**: at ``max_connections``, a new connection takes the place of the connection idle the longest
  (no request, half a request's headers, or a kept-alive connection between requests); when every held
  connection is busy with a request, the new one gets a 503 and is closed. Descriptors stay bounded by
  the cap either way, and a normal client still gets in while idle connections fill the cap.

The body deadline is the handler's (``body_timeout_s``, a 408 while a response is still possible):
only a handler knows whether it reads the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Iterator
from typing import Any, cast

import httptools
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw_router.errors import error_body

log = logging.getLogger("llmgw.router.connections")

_REFUSED_BODY = error_body(503, "too many connections to this router; retry shortly")
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n" + _REFUSED_BODY
)
# Headers that say where a request's body ends.
_FRAMING = frozenset((b"content-length", b"transfer-encoding"))
# Log the cap being reached at most this often (a flood must not become a log flood).
_LOG_EVERY_S = 60.0


# Descriptors kept for everything that is not a client connection: listeners, NATS, logs, the loop.
_FD_RESERVE = 64


def cap_for_fd_limit(max_connections: int, nofile: int) -> int:
    """The connection cap that fits the process's descriptor limit.

    Each client connection can need a second descriptor for its upstream connection, so the cap is at
    most half of what is left after a reserve; a cap above that would let clients exhaust descriptors
    before the cap is reached.
    """
    return max(1, min(max_connections, (nofile - _FD_RESERVE) // 2))


def fit_to_fd_limit(max_connections: int) -> int:
    """Raise the soft descriptor limit to the hard one if needed, and return the cap that fits it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
    cap = max_connections if soft == resource.RLIM_INFINITY else cap_for_fd_limit(max_connections, soft)
    if cap < max_connections:
        log.warning(
            "max_connections %d lowered to %d: the descriptor limit is %d (ulimit -n); "
            "each client connection can need two",
            max_connections,
            cap,
            soft,
        )
    return cap


class ConnectionGuard:
    """The router's client connections: the count, the cap, the header deadlines."""

    def __init__(self, max_connections: int, header_timeout_s: float, write_timeout_s: float = 60.0) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.write_timeout_s = write_timeout_s
        self._held: set[_Guarded] = set()
        self.evicted = 0
        self.refused = 0
        self.timed_out = 0
        self.write_timed_out = 0
        self._logged = float("-inf")

    @property
    def count(self) -> int:
        return len(self._held)

    def wrap(self, inner: asyncio.Protocol) -> asyncio.Protocol:
        return _Guarded(self, inner)

    def _admit(self, conn: _Guarded) -> bool:
        if len(self._held) >= self.max_connections:
            victim = self._longest_idle()
            if victim is None:
                self.refused += 1
                self._note_full("refusing new connections: every one held is busy with a request")
                return False
            self.evicted += 1
            self._note_full("closing the connection idle the longest for each new one")
            self._forget(victim)
            victim.close()
        self._held.add(conn)
        return True

    def _forget(self, conn: _Guarded) -> None:
        self._held.discard(conn)

    def _longest_idle(self) -> _Guarded | None:
        best: _Guarded | None = None
        for c in self._held:
            if c.idle() and (best is None or c.since < best.since):
                best = c
        return best

    def _note_full(self, what: str) -> None:
        now = time.monotonic()
        if now - self._logged >= _LOG_EVERY_S:
            self._logged = now
            log.warning(
                "%d client connections (max_connections): %s (so far: %d closed, %d refused)",
                len(self._held),
                what,
                self.evicted,
                self.refused,
            )

    def sweep(self, now: float) -> None:
        """Close connections whose request headers are late, or whose client has stopped reading."""
        late = [c for c in self._held if c.deadline is not None and now >= c.deadline]
        for c in late:
            self.timed_out += 1
            self._forget(c)
            c.close()
        stuck = [
            c
            for c in self._held
            if c.write_paused_at is not None and now - c.write_paused_at >= self.write_timeout_s
        ]
        for c in stuck:
            self.write_timed_out += 1
            self._forget(c)
            c.abort()

    async def run(self) -> None:
        """Sweep a few times per header timeout, so a deadline is kept within a quarter of it."""
        loop = asyncio.get_running_loop()
        every = min(1.0, self.header_timeout_s / 4, self.write_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            self.sweep(loop.time())


class ConnectionMetrics(Collector):
    """The guard's counts on the router's /metrics, read at scrape time."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        g = self.guard
        held = GaugeMetricFamily("llmgw_router_connections", "Client connections held now")
        held.add_metric([], g.count)
        yield held
        closed = CounterMetricFamily(
            "llmgw_router_connections_closed",
            "Client connections the router closed or refused: header_timeout, write_timeout (the "
            "client read nothing), evicted (idle, to make room at max_connections), refused "
            "(max_connections, all busy)",
            labels=["reason"],
        )
        closed.add_metric(["header_timeout"], g.timed_out)
        closed.add_metric(["write_timeout"], g.write_timed_out)
        closed.add_metric(["evicted"], g.evicted)
        closed.add_metric(["refused"], g.refused)
        yield closed


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol behind a byte-level watch of where requests' headers begin and end."""

    __slots__ = (
        "admitted",
        "deadline",
        "framing",
        "guard",
        "inner",
        "loop",
        "parser",
        "since",
        "transport",
        "write_paused_at",
    )

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.admitted = False
        # Headers must be complete by this loop time (None: not waiting for headers).
        self.deadline: float | None = None
        self.since = 0.0
        # The request's Content-Length and Transfer-Encoding header lines (to read on past an Upgrade).
        self.framing: list[bytes] = []
        # Loop time the transport paused writing (its buffer full: the client is not reading), or None.
        self.write_paused_at: float | None = None

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if not self.guard._admit(self):
            self.transport.write(_REFUSED)
            self.transport.close()
            return
        self.admitted = True
        self.since = self.loop.time()
        self.deadline = self.since + self.guard.header_timeout_s
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        self._watch(data)
        self.inner.data_received(data)

    def _watch(self, data: bytes) -> None:
        while self.parser is not None:
            try:
                self.parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as e:
                # httptools stops at any Upgrade header (or CONNECT), taking what follows the headers for
                # the new protocol. aiohttp switches for few of them and reads on otherwise: the body, then
                # more HTTP/1.1 requests (curl --http2 asks for h2c on every http:// request). Watch on
                # from where httptools stopped, with a parser told this request's body framing: bytes that
                # are not HTTP end the watch (below), and HTTP requests keep their header deadline.
                rest = data[e.args[0] :] if e.args and isinstance(e.args[0], int) else b""
                self.parser = httptools.HttpRequestParser(self)
                data = b"POST / HTTP/1.1\r\n" + b"".join(self.framing) + b"\r\n" + rest
            except httptools.HttpParserError:
                # aiohttp answers a malformed request (400) and closes; stop watching.
                self.parser, self.deadline = None, None

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.admitted = False
            self.guard._forget(self)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.write_paused_at = self.loop.time()
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.write_paused_at = None
        self.inner.resume_writing()

    # ------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        self.framing.clear()
        if self.deadline is None:
            self.since = self.loop.time()
            self.deadline = self.since + self.guard.header_timeout_s

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in _FRAMING:
            self.framing.append(name + b": " + value + b"\r\n")

    def on_headers_complete(self) -> None:
        self.deadline = None

    def on_message_complete(self) -> None:
        self.since = self.loop.time()

    # ------------------------------------------------------------ state

    def idle(self) -> bool:
        """No request on it: none begun (or its headers still coming), or between keep-alive requests."""
        if self.deadline is not None:
            return True
        # Between requests: aiohttp is not handling one and has none queued. These are aiohttp's
        # internals; if they are renamed, the defaults say "busy" and such connections are not taken.
        inner: Any = self.inner
        return getattr(inner, "_request_in_progress", True) is False and not getattr(inner, "_messages", True)

    def close(self) -> None:
        """Close; abort if response bytes are still waiting to be sent.

        A graceful close waits for those bytes to leave, for ever if the client reads nothing (it
        pipelined a stream and half of its next request, then stopped reading); the guard has stopped
        counting the connection by then, so its descriptor would be held outside the cap for good.
        """
        if self.transport is not None:
            self.transport.close()
            if self.transport.get_write_buffer_size() > 0:
                self.transport.abort()

    def abort(self) -> None:
        """Close without flushing: close() would wait for a client that reads nothing, for ever."""
        if self.transport is not None:
            self.transport.abort()


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` with every accepted connection wrapped by ``guard``, and its sweep running."""

    __slots__ = ("_guard", "_host", "_port", "_reuse_address", "_sweeper")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        backlog: int = 128,
        reuse_address: bool = True,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._reuse_address = host, port, reuse_address
        self._guard = guard
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        guard = self._guard
        self._server = await loop.create_server(
            lambda: guard.wrap(server()),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
        )
        self._sweeper = asyncio.create_task(guard.run(), name="router-connection-sweep")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await super().stop()
