"""The router's own HTTP/1.1 server (http/server.py): what aiohttp.web did for it, now its own code.

Raw sockets, so the bytes are exactly what a client sends; every check waits for a state the server
must bring about (an answer, a close, a count back at zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest

from llmgw_router.http.connection import MAX_HEAD_BYTES
from llmgw_router.http.guard import ConnectionGuard
from llmgw_router.http.request import Request
from llmgw_router.http.response import Response, StreamResponse
from llmgw_router.http.server import HttpServer
from llmgw_runtime.apikeys import hash_key
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


def _body(max_tokens: int = 2, stream: bool = False) -> bytes:
    return json.dumps(
        {
            "model": "m1",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()


def _request(body: bytes) -> bytes:
    return HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def test_a_malformed_request_line_is_400_and_the_connection_closed(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    for junk in (
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/9.x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    ):
        reader, writer = await _open(r.port)
        writer.write(junk)
        resp = await read_response(reader)
        assert resp.status == 400 and resp.headers["connection"] == "close", (junk, resp.body)
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert await closed_by_peer(reader, 5.0) == b""
        writer.close()
    await eventually(
        lambda: router_sockets(r.port) == 0 and r.connections.count == 0,
        timeout=5.0,
        what="the server to release the connection and its socket",
    )


async def test_headers_past_the_limit_are_431_and_the_connection_closed(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    # httptools gathers a header in memory until it ends: the router must stop a client that never ends it.
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    reader, writer = await _open(r.port)
    writer.write(HEAD + b"X-Big: ")
    for _ in range(MAX_HEAD_BYTES // 8192 + 2):
        writer.write(b"a" * 8192)
        await writer.drain()
    resp = await read_response(reader)
    assert resp.status == 431, resp.body
    assert await closed_by_peer(reader, 5.0) == b""
    writer.close()
    await eventually(
        lambda: router_sockets(r.port) == 0, timeout=5.0, what="the server to release the socket"
    )


async def test_pipelined_requests_are_answered_in_order_on_one_connection(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    reader, writer = await _open(r.port)
    # A stream, a models list, a non-streaming answer and a 404, all in one write.
    writer.write(
        _request(_body(5, stream=True))
        + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        + _request(_body(3))
        + b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head, head
    stream = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
    assert b"data: [DONE]" in stream
    models = await read_response(reader)
    assert models.status == 200 and [m["id"] for m in models.json()["data"]] == ["m1"]
    answer = await read_response(reader)
    assert answer.status == 200 and answer.json()["usage"]["completion_tokens"] == 3
    missing = await read_response(reader)
    assert missing.status == 404 and "connection" not in missing.headers
    # Still open for more (keep-alive).
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await read_response(reader)).status == 200
    writer.close()
    assert r.ctx.metrics.requests_count("m1", 200) == 2


async def test_head_is_answered_as_get_without_a_body(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    reader, writer = await _open(r.port)
    writer.write(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\nHEAD /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200") and b"text/html" in head
    assert b"Content-Length: 0" not in head  # the length GET would have, no body after it
    head2 = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head2.startswith(b"HTTP/1.1 405"), head2
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    # The next bytes are the health answer: nothing of the two HEAD answers' bodies came before it.
    assert (await read_response(reader)).json() == {"status": "ok"}
    writer.close()


async def test_expect_100_continue_gets_continue_before_the_body_is_sent(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    reader, writer = await _open(r.port)
    body = _body()
    writer.write(HEAD + f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    assert (await read_response(reader)).status == 200
    writer.close()


@pytest.mark.slow
async def test_a_slow_reader_of_a_long_stream_holds_bounded_memory(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    # The router writes a stream only as fast as the client reads it: its write buffer for the client
    # stays bounded, and the engine's side is held back (upstream.py pauses reading). Without the wait
    # in write() the whole stream piles up in the router's buffer (seen: 1.6 MB of a 1.6 MB stream).
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", r.port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
    assert r.http is not None
    http = r.http
    await eventually(
        lambda: len(http.connections) == 1, timeout=5.0, what="the server to hold the one connection"
    )
    # Small kernel buffers on the router's side too: what the client does not read is the router's to hold.
    (conn,) = http.connections
    assert conn.transport is not None
    conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    writer.write(_request(_body(24000, stream=True)))
    await writer.drain()
    peak = 0
    received = 0
    data = b""
    while True:
        if conn.transport is not None:
            peak = max(peak, conn.transport.get_write_buffer_size())
        chunk = await asyncio.wait_for(reader.read(8192), 10)
        if not chunk:
            break
        received += len(chunk)
        data = (data + chunk)[-64:]
        if data.endswith(b"0\r\n\r\n"):
            break
        await asyncio.sleep(0.002)  # at most 4 MB/s: slower than the engine writes
    assert b"[DONE]" in data
    assert received > 4_000_000, received  # a stream much larger than what the router may hold
    # What may be held: the transport's high-water mark (64 KB) plus what the upstream side read before
    # it paused (256 KB, and one read past it), relayed as one write. Not the stream's length.
    assert peak <= 1024 * 1024, peak
    writer.close()
    await eventually(lambda: r.ctx.metrics.in_flight == 0, timeout=5.0, what="no request to be in flight")


@pytest.mark.slow
async def test_stop_lets_a_stream_in_flight_finish_and_refuses_new_connections(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    eng = await engines("m1", ttft_ms=5, tokens_per_s=40)
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    port = r.port
    reader, writer = await _open(port)
    writer.write(_request(_body(20, stream=True)))  # about half a second
    await writer.drain()
    idle_reader, idle_writer = await _open(port)
    await eventually(
        lambda: r.ctx.metrics.in_flight == 1 and r.connections.count == 2,
        timeout=5.0,
        what="one request in flight and two connections held",
    )
    stopping = asyncio.create_task(r.stop())
    # The idle connection is closed at once; the stream runs to its end, then its connection closes.
    assert await closed_by_peer(idle_reader, 5.0) == b""
    with_stream = await closed_by_peer(reader, 10.0)
    assert with_stream.startswith(b"HTTP/1.1 200")
    assert with_stream.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), with_stream[-80:]
    await stopping
    try:
        _, w = await _open(port)
    except OSError:
        pass
    else:
        w.close()
        raise AssertionError("a new connection was accepted after stop")
    writer.close()
    idle_writer.close()


async def test_http_1_0_gets_no_chunked_framing_and_the_connection_closes(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    # An HTTP/1.0 client cannot read chunked encoding: a stream is sent as is, ended by the close.
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    for body, streamed in ((_body(3), False), (_body(3, stream=True), True)):
        reader, writer = await _open(r.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        everything = await closed_by_peer(reader, 10.0)
        head, _, payload = everything.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding" not in head, head
        if streamed:
            assert payload.startswith(b"data: {") and payload.endswith(b"data: [DONE]\n\n"), payload[-40:]
        else:
            assert json.loads(payload)["usage"]["completion_tokens"] == 3
        writer.close()


async def test_an_answer_that_fails_to_send_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    # A connection whose handler task ended without finishing its answer would otherwise keep its
    # client (and any request queued behind) waiting for ever: it is closed, with one ERROR line.
    class Broken(Response):
        async def write_eof(self, data: bytes = b"") -> None:
            raise RuntimeError("cannot send")

    async def handler(_: Request) -> StreamResponse:
        return Broken(text="never sent")

    srv = HttpServer(handler, ConnectionGuard(10, 10.0, 10.0), 1024, 60.0)
    port = await srv.listen("127.0.0.1", 0)
    try:
        reader, writer = await _open(port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await closed_by_peer(reader, 5.0) == b""
        writer.close()
        assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
            "sending the answer to GET / failed"
        ]
    finally:
        await srv.shutdown(1.0)


class SwallowsCancels:
    """A handler that swallows its first ``swallows`` cancels, as 3.11's asyncio.wait_for does when the
    cancel lands as its answer arrives (CPython gh-86296: the upstream connect), then goes on to what
    stands for the engine."""

    def __init__(self, swallows: int = 1) -> None:
        self.swallows = swallows
        self.task: asyncio.Task[object] | None = None
        self.started = asyncio.Event()
        self.swallowed = asyncio.Event()

    async def __call__(self, request: Request) -> StreamResponse:
        self.task = asyncio.current_task()
        self.started.set()
        for _ in range(self.swallows):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)
        self.swallowed.set()
        await asyncio.sleep(3600)  # the engine, generating for a client that has gone
        return Response(text="never sent")


async def test_a_handler_that_swallowed_its_clients_hang_up_is_cancelled_until_it_ends() -> None:
    # One cancel on the hang-up let such a handler go on to the engine, holding its slots, out of
    # server.connections, so nothing would ever stop it.
    handler = SwallowsCancels()
    srv = HttpServer(handler, ConnectionGuard(10, 10.0, 10.0), 1024, 60.0)
    port = await srv.listen("127.0.0.1", 0)
    try:
        _, writer = await _open(port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(handler.started.wait(), 5)
        writer.close()
        await asyncio.wait_for(handler.swallowed.wait(), 5)
        assert handler.task is not None
        done, _ = await asyncio.wait({handler.task}, timeout=5)
        assert handler.task in done
    finally:
        if handler.task is not None:
            handler.task.cancel()
        await srv.shutdown(1.0)


@pytest.mark.parametrize("client", ["connected", "gone"])
@pytest.mark.slow
async def test_shutdown_returns_after_the_handlers_it_cancelled_have_ended(client: str) -> None:
    # shutdown cancelled its connections' handlers once and never waited for them: one still running
    # after that (here: swallowing every cancel that lands at once, shutdown's, the hang-up's and its
    # finisher's first) outlived it, using the upstream client and bus the router closes next. A
    # handler whose client had gone was out of the connections, its finisher not waited for.
    handler = SwallowsCancels(swallows=3)
    srv = HttpServer(handler, ConnectionGuard(10, 10.0, 10.0), 1024, 60.0)
    port = await srv.listen("127.0.0.1", 0)
    _, writer = await _open(port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(handler.started.wait(), 5)
        if client == "gone":
            writer.close()
            await eventually(lambda: not srv.connections, timeout=5.0, what="the connection to be lost")
        shutting = asyncio.create_task(srv.shutdown(0.1))
        # Not wait_for: it would cancel shutdown.
        done, _ = await asyncio.wait({shutting}, timeout=10)
        assert shutting in done and shutting.exception() is None
        assert handler.task is not None and handler.task.done()
        assert handler.swallowed.is_set()
    finally:
        writer.close()
        if handler.task is not None:
            handler.task.cancel()


async def test_a_chunked_bodys_trailers_are_not_request_headers(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    """A key sent as a trailer after a chunked body is not a key: the request's headers are its head.

    (Trailers come through the parser's header callback after the head; a proxy or WAF in front that
    polices key headers never looks at them.)"""
    key = "sk-trailer-" + "t" * 32
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, keys=[{"name": "k", "hash": hash_key(key)}]))
    body = _body()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n"
    reader, writer = await _open(r.port)
    try:
        # Control: the same request with the key in the head is served.
        writer.write(
            HEAD + f"X-Api-Key: {key}\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + chunked + b"\r\n"
        )
        assert (await read_response(reader)).status == 200
        writer.write(
            HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked + f"X-Api-Key: {key}\r\n\r\n".encode()
        )
        refused = await read_response(reader)
        assert refused.status == 401, refused
    finally:
        writer.close()
