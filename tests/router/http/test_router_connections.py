"""Connections that hold the router's file descriptors: slow headers, slow bodies, idle keep-alive, floods.

Each test waits for a state that is false at the start (the connection open, the count high) and true
only when the router acts (the router closed it, the count came back down). Connection counts are the
router's own sockets as the kernel sees them (psutil), not the router's bookkeeping.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import psutil
import pytest

from llmgw_router.http.guard import cap_for_fd_limit
from tests.kit.poll import eventually
from tests.router.router_helpers import (
    EngineFactory,
    RouterFactory,
    StaticFile,
    closed_by_peer,
    read_response,
    router_sockets,
)

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
BODY = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).encode()


def _request(body: bytes = BODY) -> bytes:
    return HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


async def _open(port: int, data: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


async def _served(port: int) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=BODY) as resp:
            await resp.read()
            return resp.status


@pytest.mark.slow
async def test_half_a_request_line_or_half_the_headers_is_closed_after_the_header_timeout(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(
        static_file({"m1": [eng.url]}, auth=False), header_timeout_s=0.5, idle_timeout_s=60, body_timeout_s=60
    )
    t0 = time.monotonic()
    conns = [
        await _open(r.port),  # sends nothing at all
        await _open(r.port, b"POST /v1/chat/comp"),
        await _open(r.port, HEAD + b"Content-Length: 5"),
    ]
    for reader, _ in conns:
        # The router closes it (EOF), answering nothing a client could take for a response.
        assert await closed_by_peer(reader, 5.0) == b""
    assert time.monotonic() - t0 >= 0.45
    for _, writer in conns:
        writer.close()
    # On a kept-alive connection too: a served request, then half of the next one.
    reader, writer = await _open(r.port, _request())
    assert (await read_response(reader)).status == 200
    t1 = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost:")
    await writer.drain()
    assert await closed_by_peer(reader, 5.0) == b""
    assert time.monotonic() - t1 >= 0.45
    writer.close()
    await eventually(
        lambda: router_sockets(r.port) == 0, timeout=5.0, what="the router to release every socket"
    )
    assert await _served(r.port) == 200


@pytest.mark.slow
async def test_a_body_slower_than_the_body_timeout_gets_408_and_is_closed(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False), body_timeout_s=0.5, header_timeout_s=60)
    reader, writer = await _open(r.port, HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:5])
    t0 = time.monotonic()

    async def trickle() -> None:
        for i in range(5, len(BODY) - 1):
            await asyncio.sleep(0.1)  # the whole body would take several seconds
            writer.write(BODY[i : i + 1])
            await writer.drain()

    sender = asyncio.create_task(trickle())
    try:
        resp = await read_response(reader, timeout=5.0)
        assert resp.status == 408, resp.body
        assert "body" in resp.json()["error"]["message"]
        assert time.monotonic() - t0 >= 0.45
        assert resp.headers.get("connection", "").lower() == "close"
        # aiohttp reads what is left of the body for up to its lingering_time (10 s), so the client can
        # read the 408 before the close, then closes though the body never completed.
        assert await closed_by_peer(reader, 15.0) == b""
    finally:
        sender.cancel()
        writer.close()
    await eventually(
        lambda: r.ctx.metrics.in_flight == 0 and router_sockets(r.port) == 0,
        timeout=5.0,
        what="the router to release the request and every socket",
    )
    assert r.ctx.metrics.requests_count("-", 408) == 1
    assert await _served(r.port) == 200


@pytest.mark.slow
async def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False), idle_timeout_s=0.5, header_timeout_s=60)
    reader, writer = await _open(r.port, _request())
    assert (await read_response(reader)).status == 200
    t0 = time.monotonic()
    assert router_sockets(r.port) == 1
    assert await closed_by_peer(reader, 5.0) == b""
    # Not at once: the timer started when the response was sent, a moment before t0.
    assert time.monotonic() - t0 >= 0.25
    writer.close()
    await eventually(
        lambda: router_sockets(r.port) == 0, timeout=5.0, what="the router to release every socket"
    )


async def test_with_the_connection_cap_reached_the_router_still_serves_and_counts_return_to_zero(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(
        static_file({"m1": [eng.url]}, auth=False),
        max_connections=50,
        header_timeout_s=60,
        idle_timeout_s=60,
    )
    fds_before = psutil.Process().num_fds()
    idle = [await _open(r.port) for _ in range(60)]
    # All 60 accepted, the 10 beyond the cap each in place of an older idle one: 50 held, not 60.
    await eventually(
        lambda: r.connections.evicted == 10, timeout=5.0, what="the router to evict 10 idle connections"
    )
    await eventually(
        lambda: router_sockets(r.port) == 50, timeout=5.0, what="50 sockets to remain open at the cap"
    )
    # A normal request is served all the same: it takes the place of an idle connection.
    for _ in range(3):
        assert await _served(r.port) == 200
    assert router_sockets(r.port) <= 50
    # The client ends of the 60 plus the router's at most 50: not 120 descriptors.
    assert psutil.Process().num_fds() - fds_before <= 60 + 50 + 5
    assert r.connections.evicted >= 11 and r.connections.refused == 0
    text = r.ctx.metrics.exposition().decode()
    assert f'llmgw_router_connections_closed_total{{reason="evicted"}} {float(r.connections.evicted)}' in text
    for _, w in idle:
        w.close()
    await eventually(
        lambda: router_sockets(r.port) == 0, timeout=5.0, what="the router to release every socket"
    )
    await eventually(lambda: r.connections.count == 0, timeout=5.0, what="the router to count no connection")
    assert "llmgw_router_connections 0.0" in r.ctx.metrics.exposition().decode()
    assert await _served(r.port) == 200


async def test_with_every_held_connection_busy_a_new_one_gets_503_and_is_closed(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1", ttft_ms=5, tokens_per_s=20)
    r = await routers(static_file({"m1": [eng.url]}, auth=False), max_connections=2)
    stream = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "stream": True}
    ).encode()
    busy = [await _open(r.port, _request(stream)) for _ in range(2)]
    await eventually(
        lambda: eng.engine.slots.running == 2, timeout=5.0, what="both streams to run at the engine"
    )
    reader, writer = await _open(r.port)
    resp = await read_response(reader)
    assert resp.status == 503 and resp.headers["retry-after"] == "1", resp.body
    assert "too many connections" in resp.json()["error"]["message"]
    assert await closed_by_peer(reader, 5.0) == b""
    writer.close()
    assert r.connections.refused == 1 and r.connections.evicted == 0
    # The two streams were not disturbed: both still open, still generating.
    assert router_sockets(r.port) == 2 and eng.engine.slots.running == 2
    for _, w in busy:
        w.close()
    await eventually(
        lambda: router_sockets(r.port) == 0 and r.connections.count == 0,
        timeout=5.0,
        what="the router to release every socket and connection",
    )
    await eventually(
        lambda: r.ctx.metrics.in_flight == 0 and eng.engine.slots.running == 0,
        timeout=5.0,
        what="the router and the engine to finish every request",
    )
    assert await _served(r.port) == 200


def test_the_cap_fits_the_descriptor_limit() -> None:
    # Each client connection can need an upstream one: half of what is left after a reserve.
    assert cap_for_fd_limit(8192, 1024) == (1024 - 64) // 2
    assert cap_for_fd_limit(8192, 20000) == 8192
    assert cap_for_fd_limit(50, 100) == 18
    assert cap_for_fd_limit(50, 10) == 1


@pytest.mark.slow
async def test_a_client_that_stops_reading_its_stream_is_closed_after_the_write_timeout(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    # The router's writes to such a client wait for room (aiohttp's drain) with no deadline of their
    # own: the handler, its upstream connection and the engine's answer would be held for as long as
    # the client keeps the connection open. A long answer, a client that reads nothing, small buffers.
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False), write_timeout_s=0.5)
    stream = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 50000, "stream": True}
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", r.port))
    sock.setblocking(False)
    _reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(_request(stream))
    await writer.drain()
    await eventually(lambda: r.ctx.metrics.in_flight == 1, timeout=5.0, what="the request to be in flight")
    # Nothing read: the router closes the connection once its writes have waited write_timeout_s.
    await eventually(
        lambda: r.connections.write_timed_out == 1 and r.ctx.metrics.in_flight == 0,
        timeout=10.0,
        what="the router to time out the blocked write and finish the request",
    )
    await eventually(
        lambda: router_sockets(r.port) == 0 and r.connections.count == 0,
        timeout=5.0,
        what="the router to release every socket and connection",
    )
    assert r.ctx.gates.by_model["m1"].active == 0 and r.ctx.metrics.requests_count("m1", 499) == 1
    assert 'llmgw_router_connections_closed_total{reason="write_timeout"} 1.0' in (
        r.ctx.metrics.exposition().decode()
    )
    writer.close()
    assert await _served(r.port) == 200
