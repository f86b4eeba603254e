"""One keep-alive connection to an engine, as the router's upstream client uses it (``client.py``), and
the errors an exchange on it ends in.

An ``asyncio.Protocol`` with httptools' parser (what uvicorn uses): the answer's status and headers, then
its body as the bytes the engine wrote (de-chunked), buffered until read, with reading paused past
``HIGH_WATER``; typed errors that say whether anything came back.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Protocol, cast

import httptools

from llmgw_common.errors import Unavailable

# Pause reading from an engine while this much of its answer is buffered and not yet relayed.
HIGH_WATER = 256 * 1024


class UpstreamError(Unavailable):
    """The exchange with the engine failed. ``responded``: whether any byte of an answer arrived."""

    responded = False


class ConnectFailed(UpstreamError):
    """No connection: refused, unreachable, or the connect timed out."""


class Disconnected(UpstreamError):
    """The engine closed the connection (or sent bytes that are not HTTP)."""


class ReadTimeout(UpstreamError):
    """The engine sent nothing for ``read_timeout_s`` (or, once its answer had started, ``stall_timeout_s``)."""


class Aborted(UpstreamError):
    """The router gave up on the answer (:meth:`upstream.UpstreamResponse.abort`): its endpoint left the routing table."""


class Abortable(Protocol):
    """What an attempt in flight to an endpoint can be given up by (an :class:`upstream.UpstreamResponse`, or its connection
    while the answer's head is awaited)."""

    def abort(self, reason: str) -> None: ...

    def withdraw(self, reason: str, silence_s: float) -> None: ...


class Answers:
    """The attempts in flight to one endpoint, one handle each, and whether the endpoint has left the
    routing table.

    Withdrawing gives up each attempt held (once its engine is silent: :meth:`Abortable.withdraw`) and
    every attempt added afterwards: one that picked the endpoint just before it left and joins after
    (its connection was still being opened) would otherwise wait out a read timeout on a vanished node.
    """

    __slots__ = ("_held", "withdrawn")

    def __init__(self) -> None:
        self._held: set[Abortable] = set()
        self.withdrawn: tuple[str, float] | None = None  # (reason, silence_s) once withdrawn

    def add(self, a: Abortable) -> None:
        self._held.add(a)
        if self.withdrawn is not None:
            a.withdraw(*self.withdrawn)

    def discard(self, a: Abortable) -> None:
        self._held.discard(a)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, a: object) -> bool:
        return a in self._held

    def withdraw(self, reason: str, silence_s: float) -> int:
        """Give up every attempt held now and every one added later; how many were held."""
        self.withdrawn = (reason, silence_s)
        held = list(self._held)  # each attempt removes its own in its finally
        for a in held:
            a.withdraw(reason, silence_s)
        return len(held)


class UpstreamConnection(asyncio.Protocol):
    """One connection to an engine; one exchange at a time (``_reset`` before each)."""

    __slots__ = (
        "_buffered",
        "_deadline",
        "_exc",
        "_interim",
        "_paused",
        "_timer",
        "_timer_at",
        "_wait_s",
        "_waiter",
        "chunks",
        "closed",
        "complete",
        "exchange",
        "headers",
        "idle_since",
        "keep_alive",
        "last_data_at",
        "loop",
        "parser",
        "responded",
        "status",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        # Bumped by each exchange: a check scheduled for one exchange is void in the next.
        self.exchange = 0
        # The read timeout's one timer for the connection's life, not one per wait (a wait is one per
        # answer and one per streamed chunk; a timer made and cancelled each time was ~1 µs of uvloop
        # apiece): armed at the earliest deadline wanted, it re-arms itself for a wait's later one when
        # it fires early, and lapses when nothing waits. ``_deadline``: the wait's (loop time).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._deadline = 0.0
        self._wait_s = 0.0
        self.reset()

    def reset(self) -> None:
        """Ready for the next exchange on this connection."""
        self.exchange += 1
        # Loop time of the exchange's start (stamped by the client as it sends), then of the last
        # bytes the engine sent in it.
        self.last_data_at = 0.0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.responded = False
        self.keep_alive = True
        # The body's bytes received and not yet taken (take()).
        self.chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._interim = False
        self._exc: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.responded = True
        self.last_data_at = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            # Also a 101 the router never asked for (it sends no Upgrade; llhttp stops there): what
            # follows is not HTTP, and relaying the 101 would switch the client to nobody's protocol.
            self._fail(Disconnected(f"not an HTTP answer: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.complete:
            return
        if self.status and not self.keep_alive and exc is None:
            # An answer without a length ends when the connection does.
            self.complete = True
            self._wake()
            return
        self._fail(Disconnected("the engine closed the connection" + (f": {exc}" if exc else "")))

    # ------------------------------------------------------------ httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            # An interim answer (100 Continue, 103 Early Hints): not the answer. Taken for it, its end
            # would return the connection to the pool while the real answer is still coming, and the
            # next request on the connection would get that answer: one client's reply to another.
            # A 101 is never the answer either: llhttp stops at it, and data_received fails the exchange.
            self.headers = []
            self._interim = True
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self._wake()

    # ------------------------------------------------------------ waiting

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: UpstreamError) -> None:
        exc.responded = self.responded
        self._exc = exc
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    def take(self) -> bytes:
        """The body's bytes received so far (b"" if none); reading resumes once few are left."""
        chunks = self.chunks
        if len(chunks) == 1:
            data = chunks.popleft()
        else:
            data = b"".join(chunks)
            chunks.clear()
        self._buffered -= len(data)
        if self._paused and self._buffered < HIGH_WATER // 4 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, timeout: float) -> None:
        """Until the engine sends something (or ends, or fails); :class:`ReadTimeout` after ``timeout``
        seconds of nothing."""
        if self._exc is not None:
            raise self._exc
        loop = self.loop
        w = self._waiter = loop.create_future()
        self._wait_s = timeout
        deadline = self._deadline = loop.time() + timeout
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = deadline
            self._timer = loop.call_at(deadline, self._check_deadline)
        try:
            await w
        finally:
            self._waiter = None

    def _check_deadline(self) -> None:
        """The timer fired: the wait under way times out at its deadline; one begun since (a later
        deadline) has the timer again; with none, the timer lapses."""
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return
        # Within a millisecond counts as due: uvloop's clock is in whole milliseconds, and asyncio's
        # fires timers up to its clock's resolution early; re-arming for less would spin.
        if self.loop.time() + 0.001 >= self._deadline:
            e = ReadTimeout(f"no answer for {self._wait_s:g}s")
            e.responded = self.responded
            w.set_exception(e)
            return
        self._timer_at = self._deadline
        self._timer = self.loop.call_at(self._deadline, self._check_deadline)

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.close()

    def abort(self, reason: str) -> None:
        """Give up on the answer awaited (its endpoint was withdrawn): the wait raises :class:`Aborted`."""
        self._fail(Aborted(reason))
        self.close()

    def withdraw(
        self,
        reason: str,
        silence_s: float,
        give_up: Callable[[str], None] | None = None,
        exchange: int = 0,
    ) -> None:
        """The endpoint left the routing table: give up on this exchange (``give_up``, default
        :meth:`abort`) once the engine has sent nothing for ``silence_s``, checked again until then.

        Not at once: a table withdraws a node's replicas when the node is cut off from the bus, and the
        engine may well be answering still (partition case 4b: both replicas' nodes on a cut
        nats-server; every stream in flight was broken with no replica left to continue it). An engine
        that is really gone is silent, and is given up after ``silence_s``.
        """
        exchange = exchange or self.exchange
        if exchange != self.exchange or self.complete or self.closed:
            return
        quiet = self.loop.time() - self.last_data_at
        if quiet >= silence_s:
            (give_up or self.abort)(reason)
            return
        self.loop.call_later(silence_s - quiet, self.withdraw, reason, silence_s, give_up, exchange)
