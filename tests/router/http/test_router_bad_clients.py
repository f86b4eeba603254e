"""Clients that misbehave: wrong types, bodies that trickle in or stop, readers that stall and leave.

Each gets the right status (when it is still there to get one), and every count returns to zero. Each
check waits for a state that is false at the start and true only when the router did its part: a
count that went up comes back down, a request the router answered is counted, a socket it held is closed.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, RouterFactory, StaticFile, router_sockets


def _body(model: object = "m1", max_tokens: object = 2, stream: bool = False) -> bytes:
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()


async def test_wrong_types_are_400_naming_the_field(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        for bad in (5, None, ["m1"], {"name": "m1"}):
            async with s.post(
                url, data=_body(model=bad), headers={"Content-Type": "application/json"}
            ) as resp:
                err = (await resp.json())["error"]
                assert resp.status == 400 and err["param"] == "model", (bad, err)
    assert r.ctx.metrics.requests_count("-", 400) == 4
    assert r.ctx.metrics.in_flight == 0 and eng.engine._served == 0


async def _raw_request(
    port: int, body: bytes, *, send: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection and send headers plus the first ``send`` bytes of the body (all by default)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body[: len(body) if send is None else send])
    await writer.drain()
    return reader, writer


async def test_a_body_that_trickles_in_is_served(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    body = _body()
    reader, writer = await _raw_request(r.port, body, send=10)
    for i in range(10, len(body), 20):
        await asyncio.sleep(0.02)
        # Nothing reaches the engine while the body is incomplete.
        assert eng.engine._served == 0
        writer.write(body[i : i + 20])
        await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert status.startswith(b"HTTP/1.1 200"), status
    # The engine served it, and the router counted it as done.
    await eventually(
        lambda: r.ctx.metrics.requests_count("m1", 200) == 1 and eng.engine._served == 1,
        timeout=5.0,
        what="the request to be counted as served with a 200 by router and engine",
    )
    assert r.ctx.metrics.in_flight == 0


async def test_a_client_that_stops_sending_its_body_and_leaves_leaks_nothing(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    _, writer = await _raw_request(r.port, _body(), send=15)
    # The router holds the connection, waiting for the rest of the body...
    await eventually(
        lambda: router_sockets(r.port) == 1 and r.connections.count == 1,
        timeout=5.0,
        what="the router to hold the one client connection",
    )
    writer.close()  # ...and the client goes with half a body
    await writer.wait_closed()
    # The router lets go of it: its socket is closed, its count back to zero.
    await eventually(
        lambda: router_sockets(r.port) == 0 and r.connections.count == 0,
        timeout=5.0,
        what="the router to release the client connection",
    )
    assert r.ctx.metrics.in_flight == 0 and (
        "m1" not in r.ctx.gates.by_model or r.ctx.gates.by_model["m1"].active == 0
    )
    # Half a body never reaches an engine.
    assert eng.engine._served == 0 and eng.engine.slots.running == 0
    # The router still serves.
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", data=_body()) as resp:
            assert resp.status == 200
    assert eng.engine._served == 1


async def test_a_stalled_reader_that_leaves_mid_stream_releases_everything(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1", ttft_ms=5, tokens_per_s=2000)
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    reader, writer = await _raw_request(r.port, _body(max_tokens=20000, stream=True))
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
    # Read nothing more: the stream is generating, held open by the router for this client.
    await eventually(
        lambda: (
            r.ctx.metrics.in_flight == 1
            and r.ctx.gates.by_model["m1"].active == 1
            and eng.engine.slots.running == 1
        ),
        timeout=5.0,
        what="the stream to be in flight at the router, its gate and the engine",
    )
    writer.close()
    await writer.wait_closed()
    await eventually(
        lambda: r.ctx.metrics.in_flight == 0 and r.ctx.gates.by_model["m1"].active == 0,
        timeout=5.0,
        what="the router to release the request and its gate place",
    )
    # The engine was told (its connection closed) and stopped before generating 20,000 tokens.
    await eventually(
        lambda: eng.engine.slots.running == 0,
        timeout=5.0,
        what="the engine to stop generating for the departed client",
    )
    assert eng.engine._served == 0
    assert r.ctx.metrics.requests_count("m1", 499) == 1
