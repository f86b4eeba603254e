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

from router_helpers import poll, router_sockets

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


async def test_a_connection_past_its_header_deadline_with_unread_bytes_is_released(
    engines, routers, static_file
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
    assert await poll(lambda: r.connections.timed_out == 1, 10.0)
    # Dropped means dropped: the socket is gone, not left waiting to flush to a client that reads nothing.
    assert await poll(lambda: router_sockets(r.port) == 0, 5.0), router_sockets(r.port)
    assert await poll(lambda: r.ctx.in_flight == 0)
    writer.close()


async def test_a_connection_evicted_at_the_cap_with_unread_bytes_is_released(
    engines, routers, static_file
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
    assert await poll(lambda: any(c.write_paused_at is not None for c in r.connections._held), 10.0)
    # A second connection at the cap takes the place of the first (idle: its next request's headers are
    # still coming); the first must then be gone, or descriptors grow past the cap one such client at a time.
    _r2, w2 = await asyncio.open_connection("127.0.0.1", r.port)
    assert await poll(lambda: r.connections.evicted == 1)
    assert await poll(lambda: router_sockets(r.port) == 1, 5.0), router_sockets(r.port)
    w2.close()
    writer.close()
