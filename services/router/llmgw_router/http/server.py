"""The OpenAI listener's HTTP/1.1 server: one ``asyncio.Protocol`` per connection, httptools' parser.

Why not aiohttp.web: in the router's profile aiohttp.web was the largest single cost (43% of the
Python time per request), and a second parse of every request in front of it (for the header deadline
and the connection cap it lacks) cost 9% more. A raw protocol with httptools (the C parser uvicorn
uses, llhttp) serves 2-3 times aiohttp.web's rate on these machines (shared/design/HTTP-NOTES.md), and
the deadlines live in the same object that parses, so nothing is parsed twice.

The seam to the application is one handler: it takes a :class:`Request` and gives a response; the
server imports nothing of the application (an import-linter contract), which passes in the handler and
the shape of the errors the server answers itself (``error_body``).

This module is the listener: it accepts connections (``connection.Connection``), runs the sweep
that keeps the deadlines (header and write: the :class:`~llmgw_router.http.guard.ConnectionGuard`;
idle keep-alive and lingering closes: here), and drains on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from email.utils import formatdate

from llmgw_router.http.connection import Connection, ErrorBody, error_head, plain_error_body
from llmgw_router.http.guard import ConnectionGuard
from llmgw_router.http.request import Request
from llmgw_router.http.response import StreamResponse
from llmgw_runtime.runtime import cancel_and_wait

Handler = Callable[[Request], Awaitable[StreamResponse]]

log = logging.getLogger("llmgw.router.http")


class _Clock:
    """The ``Date`` header, formatted once a second (the guard's sweep ticks it)."""

    __slots__ = ("header", "second")

    def __init__(self) -> None:
        self.second = -1
        self.header = b""
        self.tick()

    def tick(self) -> None:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.header = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"


class HttpServer:
    """The listener: accepts connections into :class:`Connection`, runs the guard's sweep, drains."""

    def __init__(
        self,
        handler: Handler,
        guard: ConnectionGuard,
        max_body_bytes: int,
        idle_timeout_s: float,
        trusted_proxies: Sequence[str] = (),
        error_body: ErrorBody = plain_error_body,
    ) -> None:
        self.handler = handler
        self.error_body = error_body
        # Clients whose X-Forwarded-* headers are believed (the proxies in front); none by default.
        self.trusted_proxies = [ipaddress.ip_network(p, strict=False) for p in trusted_proxies]
        self.guard = guard
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.loop = asyncio.get_running_loop()
        self.clock = _Clock()
        self.connections: set[Connection] = set()
        self.draining = False
        self.refused = error_head(
            503, error_body(503, "too many connections to this router; retry shortly")
        ).replace(b"Connection: close\r\n", b"Retry-After: 1\r\nConnection: close\r\n")
        self._servers: list[asyncio.AbstractServer] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._idle_event = asyncio.Event()
        # Handlers of connections that are gone, each with the task that cancels it until it ends.
        self._ending: dict[asyncio.Task[None], asyncio.Task[None]] = {}

    def trusts(self, peer: object) -> bool:
        """Whether a client at ``peer`` (a transport's peername) is one of the trusted proxies."""
        if not self.trusted_proxies or not isinstance(peer, tuple) or not peer:
            return False
        try:
            addr = ipaddress.ip_address(peer[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped  # a dual-stack listener's IPv4 client
        return any(addr in net for net in self.trusted_proxies)

    def _make(self) -> Connection:
        c = Connection(self)
        self.connections.add(c)
        return c

    async def listen(self, host: str, port: int, *, backlog: int = 4096, reuse_port: bool = False) -> int:
        """Start listening; the bound port."""
        srv = await self.loop.create_server(
            self._make, host, port, backlog=backlog, reuse_address=True, reuse_port=reuse_port or None
        )
        self._servers.append(srv)
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_loop(), name="router-connection-sweep")
        for s in srv.sockets:
            if s.family in (socket.AF_INET, socket.AF_INET6):
                return int(s.getsockname()[1])
        return 0

    async def _sweep_loop(self) -> None:
        g = self.guard
        every = min(1.0, g.header_timeout_s / 4, g.write_timeout_s / 4, self.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = self.loop.time()
            self.clock.tick()
            g.sweep(now)
            self.sweep_idle(now)

    def sweep_idle(self, now: float) -> None:
        """Close keep-alive connections idle past the idle timeout, and lingering ones past their time."""
        limit = self.idle_timeout_s
        for c in [
            c
            for c in self.connections
            if (c.idle_since is not None and now - c.idle_since >= limit) or c.lingered_out(now)
        ]:
            if c.lingered_out(now):
                c.end_linger()
            else:
                c.close()

    def end_handler(self, handler: asyncio.Task[None]) -> None:
        """Cancel ``handler``, whose connection is gone, until it has ended.

        One cancel is not enough: Python 3.11's ``asyncio.wait_for`` (the upstream connect's) drops a
        cancel that lands as its answer arrives (CPython gh-86296), and the handler would go on to the
        engine for a client that has gone, holding an admission place and an engine slot, out of
        ``connections`` where nothing would find it again.
        Only for a connection lost with a handler under way: nothing on an answered request's path.
        """
        if handler in self._ending or handler.done():
            return
        finisher = self.loop.create_task(cancel_and_wait([handler]), name="router-end-handler")
        self._ending[handler] = finisher
        finisher.add_done_callback(lambda _: self._ending.pop(handler, None))

    def idle_changed(self) -> None:
        if self.draining:
            self._idle_event.set()

    def busy(self) -> int:
        return sum(1 for c in self.connections if c.busy())

    async def shutdown(self, grace_s: float, end_s: float = 5.0) -> None:
        """Stop accepting; let requests in flight finish for up to ``grace_s``; close everything; wait up
        to ``end_s`` for the handlers cancelled then (and before, by their clients' hang-ups) to end."""
        self.draining = True
        for srv in self._servers:
            srv.close()
        # Idle keep-alive connections and connections with no request yet are closed now; busy ones
        # get "Connection: close" on their answer (draining) and close when it is out.
        for c in list(self.connections):
            if not c.busy():
                c.close()
        deadline = self.loop.time() + grace_s
        while self.busy() and self.loop.time() < deadline:
            self._idle_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._idle_event.wait(), min(0.1, max(0.0, deadline - self.loop.time()))
                )
        for c in list(self.connections):
            c.stop_handler()
            c.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        # The handlers cancelled, here or by their hang-ups, have ended before the router closes the
        # upstream client and the bus they use; one that ends in none of end_s is a bug: logged, left.
        # (This stop cancelled meanwhile, the finishers still end them.)
        if self._ending:
            _, left = await asyncio.wait(set(self._ending.values()), timeout=end_s)
            if left:
                log.error("%d request handlers still running %gs after they were cancelled", len(left), end_s)
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 1.0)
        self._servers = []
