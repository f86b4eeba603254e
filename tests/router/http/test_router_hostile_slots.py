"""Connection places: clients that never read must not hold them all, and admission at the cap is cheap.

The first test is end to end (raw sockets with tiny receive buffers that read nothing, a real engine's
long streams); the second drives the guard itself with connections that count how often they are
looked at, since what it checks is how much work one admission does.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from llmgw_router.http.guard import ConnectionGuard
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, RouterFactory, StaticFile, raw_exchange


async def _stalled_stream(port: int) -> tuple[socket.socket, asyncio.StreamWriter]:
    body = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 50000, "stream": True}
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    await writer.drain()
    return sock, writer


@pytest.mark.slow
async def test_clients_that_read_nothing_do_not_hold_every_place(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    # They counted as busy and were never evicted: until write_timeout_s (60 s) every new client got 503.
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False), max_connections=3)
    assert r.http is not None
    held = [await _stalled_stream(r.port) for _ in range(3)]
    http = r.http
    await eventually(
        lambda: sum(1 for c in http.connections if c.write_paused_at is not None) == 3,
        timeout=10.0,
        what="the router's writes to all three clients to wait for room",
    )
    resp = await raw_exchange(r.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert resp.status == 200, resp.body
    assert r.connections.evicted_stalled == 1 and r.connections.refused == 0
    assert 'llmgw_router_connections_closed_total{reason="evicted_stalled"} 1.0' in (
        r.ctx.metrics.exposition().decode()
    )
    for _, w in held:
        w.close()
    await eventually(lambda: r.ctx.metrics.in_flight == 0, timeout=10.0, what="every stream to be released")


class _Conn:
    """What the guard reads of a connection, counting how often it asks whether the connection is idle."""

    looked = 0

    def __init__(self, since: float, idle: bool) -> None:
        self.deadline: float | None = None
        self.since = since
        self.write_paused_at: float | None = None
        self._idle = idle
        self.closed = False

    def idle(self) -> bool:
        _Conn.looked += 1
        return self._idle

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def test_admission_at_the_cap_does_not_look_at_every_connection() -> None:
    # It scanned every held connection for the one idle the longest: 0.02 -> 0.60 ms per new one at 8,192.
    cap = 8192
    g = ConnectionGuard(cap, 10.0, 60.0)
    conns = [_Conn(float(i), idle=False) for i in range(cap)]
    for c in conns:
        assert g.admit(c)
        g.became_idle(c)
    # All busy now but three, which became idle again later, in this order.
    for c in conns:
        c._idle = False
    late = [conns[5000], conns[17], conns[8000]]
    for t, c in enumerate(late):
        c.since, c._idle = cap + float(t), True
        g.became_idle(c)
    _Conn.looked = 0
    newcomers = [_Conn(10_000.0 + i, idle=False) for i in range(3)]
    for n in newcomers:
        assert g.admit(n)
    assert [c.closed for c in late] == [True, True, True]
    # With nothing idle left, a hundred more are refused.
    for i in range(100):
        assert not g.admit(_Conn(20_000.0 + i, idle=False))
    # Each entry in the idle queue is looked at once, ever: the busy ones' entries once in all, not once
    # per admission (which was 103 x 8,192 looks).
    assert _Conn.looked <= cap + 2 * len(late), _Conn.looked
    assert g.evicted == 3 and g.refused == 100 and g.count == cap
