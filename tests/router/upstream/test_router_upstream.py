"""The router's upstream HTTP/1.1 client, against raw servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

import pytest
import uvloop

from llmgw_router.upstream.client import UpstreamClient
from llmgw_router.upstream.connection import Aborted, Answers, ConnectFailed, Disconnected, ReadTimeout
from llmgw_sim import serving as sim_engine
from llmgw_sim.options import SimOptions
from tests.kit.poll import eventually

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
BODY = b'{"model":"m","prompt":"x","max_tokens":3}'


class RawServer:
    """A server running ``handler`` for each connection, whose :meth:`close` waits for its handlers.

    A handler still running when the scenario's loop closes is cancelled there, and asyncio's stream
    server then logs "Exception in callback" for it; every handler here ends once the client is closed.
    """

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.handlers: set[asyncio.Task[Any]] = set()

    async def start(self) -> str:
        self.srv = await asyncio.start_server(self._wrapped, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.srv.sockets[0].getsockname()[1]}"

    async def _wrapped(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            await self.handler(r, w)
        finally:
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()

    async def close(self) -> None:
        """Close the server and wait for its handlers (close the client first: they end with it)."""
        self.srv.close()
        if self.handlers:
            _, pending = await asyncio.wait(self.handlers, timeout=5.0)
            assert not pending, f"raw server handlers still running: {pending}"
        await self.srv.wait_closed()


async def _raw_server(handler: Handler) -> tuple[RawServer, str]:
    srv = RawServer(handler)
    return srv, await srv.start()


async def _read_request(r: asyncio.StreamReader) -> None:
    head = await r.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    await r.readexactly(length)


async def scenario_keep_alive_reuse() -> None:
    eng = await sim_engine.start(SimOptions(port=0, zero=True, model="m"))
    c = UpstreamClient(2.0, 5.0)
    try:
        r1 = await c.post(eng.url, "/v1/completions", BODY)
        assert r1.status == 200 and b'"completion_tokens": 3' in await r1.read()
        conn = next(iter(c._idle.values()))[0]
        r2 = await c.post(eng.url, "/v1/completions", BODY)
        assert r2._conn is conn
        # A short answer is all here with its head: taken whole, without a wait (read's own fast path).
        await eventually(lambda: r2._conn.complete, timeout=2.0, every=0.01, what="the whole answer")
        whole = r2.take_whole()
        assert whole is not None and whole.startswith(b"{") and r2.at_eof()
        # Taken once: then nothing, and the connection is back in the pool once.
        assert r2.take_whole() is None and await r2.read() == b""
        assert await r2.readany() == b"" and len(next(iter(c._idle.values()))) == 1
        stream = await c.post(eng.url, "/v1/completions", BODY.replace(b"}", b',"stream":true}'))
        data = await stream.read()
        assert data.endswith(b"data: [DONE]\n\n") and stream.content_length is None
        # A burst opens what it needs; only max_idle_per_endpoint connections stay for reuse.
        c.max_idle_per_endpoint = 2
        burst = await asyncio.gather(*(c.post(eng.url, "/v1/completions", BODY) for _ in range(5)))
        for r in burst:
            await r.read()
        assert len(next(iter(c._idle.values()))) == 2
    finally:
        await c.close()
        await eng.runner.cleanup()


async def scenario_server_closed_idle_connection() -> None:
    async def one_then_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        w.close()  # keep-alive was implied, yet the server closes

    srv, url = await _raw_server(one_then_close)
    c = UpstreamClient(2.0, 5.0)
    try:
        for _ in range(3):
            r = await c.post(url, "/x", b"{}")
            assert await r.read() == b"ok"
    finally:
        await c.close()
        await srv.close()


async def scenario_a_connection_closed_before_the_protocol_is_told() -> None:
    """An engine killed under traffic: a connection's transport is closed (uvloop: its handle) while
    the protocol's connection_lost is still to come. Written to then, uvloop raised RuntimeError and
    the client got a 500 (chaos node loss, in CI); asyncio dropped the bytes and the answer was awaited
    until read_timeout_s. Now it is a Disconnected: retried on a new connection."""
    eng = await sim_engine.start(SimOptions(port=0, zero=True, model="m"))
    c = UpstreamClient(2.0, 5.0)
    try:
        r1 = await c.post(eng.url, "/v1/completions", BODY)
        await r1.read()
        key, idle = next(iter(c._idle.items()))
        (conn,) = idle
        assert conn.transport is not None
        conn.transport.close()
        await eventually(lambda: conn.closed, timeout=2.0, every=0.01, what="the transport closed")
        # The state of the race: the transport is gone, the protocol not yet told.
        conn.closed = False
        with pytest.raises(Disconnected, match="closed the connection"):
            await c._exchange(key, conn, b"POST / HTTP/1.1\r\n\r\n", b"", None)
        conn.closed = False
        idle.append(conn)
        r2 = await asyncio.wait_for(c.post(eng.url, "/v1/completions", BODY), 3.0)
        assert r2._conn is not conn
        assert b'"completion_tokens": 3' in await r2.read()
    finally:
        await c.close()
        await eng.runner.cleanup()


async def scenario_length_by_close_garbage_timeout_refused() -> None:
    async def until_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello ")
        await w.drain()
        w.write(b"world")
        w.close()

    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await w.drain()
        w.close()

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        await r.read()  # until the client gives up and closes

    async def cut(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await w.drain()
        w.close()

    servers = [await _raw_server(h) for h in (until_close, garbage, silent, cut)]
    c = UpstreamClient(1.0, 0.2)
    try:
        r = await c.post(servers[0][1], "/", b"{}")
        assert await r.read() == b"hello world"
        with pytest.raises(Disconnected) as e:
            await c.post(servers[1][1], "/", b"{}")
        assert e.value.responded
        with pytest.raises(ReadTimeout):
            await c.post(servers[2][1], "/", b"{}")
        r = await c.post(servers[3][1], "/", b"{}")
        with pytest.raises(Disconnected):
            await r.read()
        srv_dead, dead = await _raw_server(until_close)
        await srv_dead.close()
        with pytest.raises(ConnectFailed) as cf:
            await c.post(dead, "/", b"{}")
        assert not cf.value.responded and "cannot connect" in str(cf.value)
    finally:
        await c.close()
        for s, _ in servers:
            await s.close()


async def scenario_large_answer_with_flow_control() -> None:
    big = bytes(range(256)) * 8192  # 2 MiB: pauses and resumes reading several times

    async def large(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(big), 65536):
            part = big[i : i + 65536]
            w.write(b"%x\r\n" % len(part) + part + b"\r\n")
            await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()

    srv, url = await _raw_server(large)
    c = UpstreamClient(1.0, 5.0)
    try:
        r = await c.post(url, "/", b"{}")
        got = bytearray()
        while chunk := await r.readany():
            got += chunk
            await asyncio.sleep(0)  # a slow reader
        assert bytes(got) == big and r.at_eof()
    finally:
        await c.close()
        await srv.close()


class _ClosingEngine(asyncio.Protocol):
    """Answers each request, but closes kept-alive connections at random moments (seeded): before an
    answer, right after one, or a little later, racing the client's next request on that connection."""

    OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    def __init__(self, rng: random.Random, counts: dict[str, int]) -> None:
        self.rng, self.counts, self.buf = rng, counts, b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            n = next(
                int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")
            )
            if len(rest) < n:
                return
            self.buf = rest[n:]
            x = self.rng.random()
            if x < 0.03:
                self.counts["unanswered"] += 1
                self.t.close()
                return
            self.t.write(self.OK)
            self.counts["answered"] += 1
            if x < 0.10:
                delay = self.rng.choice([0.0, 0.0005, 0.002])
                if delay:
                    asyncio.get_running_loop().call_later(delay, self.t.close)
                else:
                    self.t.close()
                return


async def scenario_engine_closing_kept_alive_connections_at_random_never_stalls() -> None:
    # The bench's hang hypotheses for this pool: a kept-alive connection the engine closed being reused,
    # a connection returned before its answer was read, a waiter never woken. Any of them shows here as
    # a request that ends only by its read timeout.
    loop = asyncio.get_running_loop()
    counts = {"answered": 0, "unanswered": 0}
    rng = random.Random(24)
    srv = await loop.create_server(lambda: _ClosingEngine(rng, counts), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    c = UpstreamClient(2.0, 3.0)
    outcomes: dict[str, int] = {}

    async def worker() -> None:
        for _ in range(30):
            try:
                r = await c.post(url, "/v1/x", b"{}")
                assert await r.read() == b"{}"
                what = "ok"
            except Disconnected:
                what = "disconnected"
            outcomes[what] = outcomes.get(what, 0) + 1

    try:
        # ReadTimeout is not caught: one stalled request fails the scenario.
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(32))), 60)
    finally:
        await c.close()
        srv.close()
    assert sum(outcomes.values()) == 32 * 30
    # Only a request the engine dropped unanswered fails (a reused connection is retried on a new one).
    assert outcomes.get("disconnected", 0) <= counts["unanswered"]
    assert outcomes["ok"] >= 0.9 * 32 * 30 and counts["answered"] >= outcomes["ok"]


async def scenario_slow_first_byte_then_a_stall_and_an_abort() -> None:
    # Headers at once, the first body bytes after a "prefill" longer than the stall timeout, then silence.
    async def prefill_then_stall(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.6)
        w.write(b"3\r\nabc\r\n")
        await w.drain()
        await r.read()  # open and silent until the client closes

    srv, url = await _raw_server(prefill_then_stall)
    c = UpstreamClient(1.0, 5.0, stall_timeout_s=0.3)
    try:
        r = await c.post(url, "/", b"{}")
        assert await r.readany() == b"abc"  # 0.6 s before it: the read timeout, not the stall, applied
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ReadTimeout):
            await r.readany()
        assert asyncio.get_running_loop().time() - t0 < 2.0
        r.close()
        # An abort wakes a read waiting on a silent engine, and every later read raises too.
        r = await c.post(url, "/", b"{}")
        assert await r.readany() == b"abc"
        waiting = asyncio.ensure_future(r.readany())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        r.abort("withdrawn")
        with pytest.raises(Aborted, match="withdrawn"):
            await waiting
        with pytest.raises(Aborted):
            await r.readany()
    finally:
        await c.close()
        await srv.close()


async def scenario_one_timer_serves_a_connection_and_each_wait_keeps_its_own_deadline() -> None:
    """The read timeout is one timer per connection, not one per wait: a wait begun after the timer
    was armed for an earlier one's deadline times out at its own, not at the timer's first firing."""

    async def slow_then_silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        await asyncio.sleep(0.3)  # within the 0.5 s read timeout
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        await _read_request(r)
        await r.read()  # the second request on the kept-alive connection: no answer

    srv, url = await _raw_server(slow_then_silent)
    c = UpstreamClient(1.0, 0.5)
    loop = asyncio.get_running_loop()
    try:
        r = await c.post(url, "/", b"{}")
        assert await r.read() == b"ok"
        conn = r._conn
        timer = conn._timer  # armed for the first wait's deadline, about 0.2 s from now
        assert timer is not None and not timer.cancelled()
        t0 = loop.time()
        with pytest.raises(ReadTimeout, match=r"no answer for 0\.5s"):
            await c.post(url, "/", b"{}")
        # On the same connection, with no timer of its own: the first firing found it not yet due.
        assert conn._timer is None
        assert 0.45 <= loop.time() - t0 < 2.0
    finally:
        await c.close()
        await srv.close()


async def scenario_abort_while_the_head_is_awaited() -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        await r.read()  # no answer at all until the client closes

    srv, url = await _raw_server(silent)
    c = UpstreamClient(1.0, 30.0)
    held = Answers()
    try:
        post = asyncio.ensure_future(c.post(url, "/", b"{}", held=held))
        await eventually(lambda: held, timeout=2.0, every=0.01, what="the post to be held, abortable")
        assert len(held) == 1 and not post.done()
        held.withdraw("withdrawn", 0.0)
        with pytest.raises(Aborted, match="withdrawn"):
            await asyncio.wait_for(post, 2.0)
        assert not held  # the attempt's handle is gone with it
    finally:
        await c.close()
        await srv.close()


async def scenario_an_attempt_that_reaches_a_withdrawn_endpoint_is_given_up() -> None:
    """The endpoint left the routing table while an attempt that had picked it was still opening its
    connection: the attempt is given up once the engine is silent, not left to wait out its read
    timeout (30 s here; 600 s by default) on a node that vanished."""

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        await r.read()

    srv, url = await _raw_server(silent)
    c = UpstreamClient(1.0, 30.0)
    held = Answers()
    assert held.withdraw("r1 was withdrawn", 0.2) == 0  # nothing in flight yet
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(Aborted, match="r1 was withdrawn"):
            await asyncio.wait_for(c.post(url, "/", b"{}", held=held), 5.0)
        assert 0.2 <= loop.time() - t0 < 2.0  # after the engine's silence, not at once
        assert not held
    finally:
        await c.close()
        await srv.close()


Scenario = Callable[[], Coroutine[Any, Any, None]]
SCENARIOS: list[Scenario] = [
    scenario_keep_alive_reuse,
    scenario_server_closed_idle_connection,
    scenario_a_connection_closed_before_the_protocol_is_told,
    scenario_length_by_close_garbage_timeout_refused,
    scenario_large_answer_with_flow_control,
    scenario_engine_closing_kept_alive_connections_at_random_never_stalls,
    scenario_slow_first_byte_then_a_stall_and_an_abort,
    scenario_one_timer_serves_a_connection_and_each_wait_keeps_its_own_deadline,
    scenario_abort_while_the_head_is_awaited,
    scenario_an_attempt_that_reaches_a_withdrawn_endpoint_is_given_up,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
@pytest.mark.slow
async def test_upstream_on_asyncio(scenario: Scenario) -> None:
    await scenario()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
@pytest.mark.slow
def test_upstream_on_uvloop(scenario: Scenario) -> None:
    # The router runs on uvloop in production; its transports differ from asyncio's.
    uvloop.run(scenario())
