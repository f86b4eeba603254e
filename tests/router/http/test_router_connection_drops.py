"""Connections the router drops itself (header deadline, eviction at the cap) give back their socket.

A connection the guard drops may still hold response bytes the client has not read (it pipelined a
stream and half of a next request, then read nothing). Closing such a transport gracefully waits for
those bytes to leave, for ever; once the guard has stopped counting it, nothing else would end it and
its descriptor would be held outside the cap. Counts are the router's sockets as the kernel sees them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest

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
STREAM = json.dumps(
    {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 50000, "stream": True}
).encode()


def _request(body: bytes) -> bytes:
    return HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


async def _non_reader(port: int, data: bytes) -> asyncio.StreamWriter:
    """A connection with a small receive buffer that sends ``data`` and never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    _reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(data)
    await writer.drain()
    return writer


@pytest.mark.slow
async def test_a_connection_past_its_header_deadline_with_unread_bytes_is_released(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(
        static_file({"m1": [eng.url]}, auth=False),
        header_timeout_s=0.5,
        write_timeout_s=600,
        idle_timeout_s=600,
    )
    # A long stream, then half of the next request: its header deadline runs while the stream's bytes
    # wait in the router's buffer for a reader that never comes.
    writer = await _non_reader(r.port, _request(STREAM) + b"POST /v1/chat/completions HTTP/1.1\r\nHo")
    await eventually(
        lambda: r.connections.timed_out == 1,
        timeout=10.0,
        what="the router to time out the connection's headers",
    )
    # Dropped means dropped: the socket is gone, not left waiting to flush to a client that reads nothing.
    await eventually(
        lambda: router_sockets(r.port) == 0,
        timeout=5.0,
        what="the router to release the timed-out connection's socket",
    )
    await eventually(lambda: r.ctx.metrics.in_flight == 0, timeout=5.0, what="no request to be in flight")
    writer.close()


async def test_a_connection_evicted_at_the_cap_with_unread_bytes_is_released(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(
        static_file({"m1": [eng.url]}, auth=False),
        max_connections=1,
        header_timeout_s=600,
        write_timeout_s=600,
        idle_timeout_s=600,
    )
    writer = await _non_reader(r.port, _request(STREAM) + b"POST /v1/chat/completions HTTP/1.1\r\nHo")
    # The stream has filled the buffers: the router's writes to this client wait for room.
    await eventually(
        lambda: any(c.write_paused_at is not None for c in r.connections._held),
        timeout=10.0,
        what="the router to pause writing to the connection that reads nothing",
    )
    # A second connection at the cap takes the place of the first (idle: its next request's headers are
    # still coming); the first must then be gone, or descriptors grow past the cap one such client at a time.
    _r2, w2 = await asyncio.open_connection("127.0.0.1", r.port)
    await eventually(
        lambda: r.connections.evicted == 1, timeout=5.0, what="the router to evict one connection"
    )
    await eventually(
        lambda: router_sockets(r.port) == 1,
        timeout=5.0,
        what="only the new connection's socket to remain open",
    )
    w2.close()
    writer.close()


def _chunked(body: bytes) -> bytes:
    return (
        b"Transfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % 7
        + body[:7]
        + b"\r\n"
        + (b"%x\r\n" % (len(body) - 7) + body[7:] + b"\r\n0\r\n\r\n")
    )


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.slow
async def test_an_upgrade_header_aiohttp_does_not_act_on_leaves_the_header_deadline_in_force(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile, framing: str
) -> None:
    # curl --http2 on an http:// URL asks for h2c this way. aiohttp serves the request as plain HTTP/1.1
    # (body included) and keeps the connection; its next requests must still have their header deadline.
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False), header_timeout_s=0.5, idle_timeout_s=60)
    h2c = (
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
    )
    body = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    ).encode()
    rest = (
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        if framing == "content-length"
        else _chunked(body)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    # Twice on one connection: the second request is found where aiohttp finds it, after the first's body.
    for _ in range(2):
        writer.write(HEAD + h2c + rest)
        await writer.drain()
        assert (await read_response(reader)).status == 200
    t0 = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost:")
    await writer.drain()
    assert await closed_by_peer(reader, 5.0) == b""
    assert time.monotonic() - t0 >= 0.45
    assert r.connections.timed_out == 1
    writer.close()


async def test_a_protocol_switch_aiohttp_refuses_is_answered_and_the_router_serves_on(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    # What follows a websocket or CONNECT request is not HTTP: watching it must neither fail nor stall.
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False), header_timeout_s=0.5, idle_timeout_s=60)
    for head in (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        writer.write(head + b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58")
        await writer.drain()
        assert (await read_response(reader)).status in (200, 404, 405)
        writer.close()
    await eventually(
        lambda: router_sockets(r.port) == 0, timeout=5.0, what="the router to release the connection's socket"
    )
    body = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    ).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", data=body) as resp:
            assert resp.status == 200
