"""Upstreams that answer oddly on purpose: an interim 1xx, a 204/304, an unasked 101, hop-by-hop fields.

The upstream is the test's own raw socket server, so its bytes are exactly what a misbehaving engine
(or anything in front of one) sends; the client side is raw sockets too, reading the router's answer
byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import pytest

from tests.router.router_helpers import RouterFactory, StaticFile, read_response

# What the upstream answers to its n-th request (n from 1): a list of byte strings, written with a
# short pause between them, so each arrives at the router in its own read.
Script = Callable[[int], list[bytes]]


class OddUpstream:
    """A keep-alive HTTP/1.1 server that answers every request with ``script(n)``, as raw bytes."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests = 0
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v)
                await reader.readexactly(length)
                self.requests += 1
                for i, part in enumerate(self.script(self.requests)):
                    if i:
                        await asyncio.sleep(0.05)
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> OddUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)


@contextlib.asynccontextmanager
async def odd_upstream(script: Script) -> AsyncIterator[OddUpstream]:
    async with OddUpstream(script) as up:
        yield up


BODY = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}]}).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    + b"Content-Length: %d\r\n\r\n" % len(BODY)
    + BODY
)


def _answer(n: int, extra: bytes = b"") -> bytes:
    body = b'{"answer": %d}' % n
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        extra,
        len(body),
        body,
    )


async def _ask(port: int) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(REQUEST)
        resp = await read_response(reader)
        return resp.status, resp.headers, resp.body
    finally:
        writer.close()


async def test_an_interim_103_is_not_taken_for_the_answer_and_no_answer_reaches_another_client(
    routers: RouterFactory, static_file: StaticFile
) -> None:
    # 103 Early Hints, then (in a later read) the real answer. Taken for the answer, the 103 was relayed
    # and its connection pooled while the 200 was still coming: the next client got that 200.
    def script(n: int) -> list[bytes]:
        return [b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n", _answer(n)]

    async with odd_upstream(script) as up:
        r = await routers(static_file({"m1": [up.url]}, auth=False))
        for n in (1, 2, 3):
            status, headers, body = await _ask(r.port)
            assert (status, json.loads(body)) == (200, {"answer": n}), (n, status, body)
            assert "link" not in headers, headers
        # One connection to the upstream, reused: each answer was read whole before it was pooled.
        assert up.connections == 1 and up.requests == 3


async def test_a_100_continue_from_the_engine_is_skipped_too(
    routers: RouterFactory, static_file: StaticFile
) -> None:
    def script(n: int) -> list[bytes]:
        return [b"HTTP/1.1 100 Continue\r\n\r\n", _answer(n)]

    async with odd_upstream(script) as up:
        r = await routers(static_file({"m1": [up.url]}, auth=False))
        for n in (1, 2):
            status, _, body = await _ask(r.port)
            assert (status, json.loads(body)) == (200, {"answer": n}), (status, body)


async def test_an_unasked_101_is_not_relayed(routers: RouterFactory, static_file: StaticFile) -> None:
    def script(n: int) -> list[bytes]:
        return [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n\x00\x01"]

    async with odd_upstream(script) as up:
        r = await routers(static_file({"m1": [up.url]}, auth=False), retries=0)
        status, headers, body = await _ask(r.port)
        assert status == 502, (status, body)
        assert "upgrade" not in headers, headers


@pytest.mark.parametrize("status", [204, 304])
async def test_a_204_or_304_is_relayed_without_a_body_or_framing(
    routers: RouterFactory, static_file: StaticFile, status: int
) -> None:
    # Relayed as a chunked stream, the answer carried "Transfer-Encoding: chunked" and "0\r\n\r\n": a
    # strict client reads those five bytes as the start of the next answer on the connection.
    def script(n: int) -> list[bytes]:
        if n == 1:
            return [b"HTTP/1.1 %d Nothing\r\nX-Kept: yes\r\n\r\n" % status]
        return [_answer(n)]

    async with odd_upstream(script) as up:
        r = await routers(static_file({"m1": [up.url]}, auth=False))
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        try:
            # Two requests on one connection: the second answer must start right after the first's head.
            writer.write(REQUEST)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 %d" % status), head
            lower = head.lower()
            assert b"transfer-encoding" not in lower and b"content-length" not in lower, head
            assert b"x-kept: yes" in lower, head
            writer.write(REQUEST)
            nxt = await read_response(reader)
            assert (nxt.status, nxt.json()) == (200, {"answer": 2}), (nxt.status, nxt.body)
        finally:
            writer.close()


async def test_fields_named_in_the_engines_connection_header_are_not_relayed(
    routers: RouterFactory, static_file: StaticFile
) -> None:
    # RFC 9110 §7.6.1: a field named in Connection is for that hop only, never forwarded.
    def script(n: int) -> list[bytes]:
        return [
            _answer(
                n, b"Connection: keep-alive, X-Hop-Secret\r\nX-Hop-Secret: s3cr3t\r\nX-End-To-End: kept\r\n"
            )
        ]

    async with odd_upstream(script) as up:
        r = await routers(static_file({"m1": [up.url]}, auth=False))
        status, headers, body = await _ask(r.port)
        assert (status, json.loads(body)) == (200, {"answer": 1}), (status, body)
        assert "x-hop-secret" not in headers and headers.get("x-end-to-end") == "kept", headers
