"""Clients that bend HTTP/1.1 on purpose: big heads in one read, long pipelines, doubled fields.

Raw sockets, so the bytes are exactly what such a client sends; every check waits for an answer or a
close the server must make.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from llmgw_router.http.connection import MAX_HEAD_BYTES, MAX_PIPELINE
from llmgw_runtime.apikeys import hash_key
from tests.router.router_helpers import (
    EngineFactory,
    RouterFactory,
    StaticFile,
    closed_by_peer,
    raw_exchange,
    read_response,
)

KEY = "llmgw-hostile-clients-test-key-Zq8Xw3Rt5Yu7Io9Pa1Sd2Fg4Hj6Kl0M"
# Never reached: nothing here is proxied.
NOWHERE = "http://127.0.0.1:9"


async def _router(routers: RouterFactory, static_file: StaticFile) -> int:
    r = await routers(static_file({"m1": [NOWHERE]}, keys=[{"name": "k", "hash": hash_key(KEY)}]))
    return r.port


@pytest.mark.parametrize("size", [70 * 1024, 200 * 1024])
@pytest.mark.parametrize("after_another", [False, True])
async def test_a_head_over_the_limit_is_431_even_when_it_comes_in_one_read(
    routers: RouterFactory, static_file: StaticFile, size: int, after_another: bool
) -> None:
    # The limit was counted by reads still waiting for a head's end: a head whole in one read passed.
    port = await _router(routers, static_file)
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
    first = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" if after_another else b""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(first + big)
        if after_another:
            ok = await read_response(reader)
            assert ok.status == 200
        resp = await read_response(reader)
        assert resp.status == 431 and resp.headers["connection"] == "close", (resp.status, resp.body)
        assert await closed_by_peer(reader, 5.0) == b""
    finally:
        writer.close()
    # A head just under the limit, in one read, is served.
    fits = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES - 100) + b"\r\n\r\n"
    assert (await raw_exchange(port, fits)).status == 200


async def test_a_pipeline_longer_than_the_bound_is_answered_up_to_it_then_closed(
    routers: RouterFactory, static_file: StaticFile
) -> None:
    # Every request one read brings was parsed and queued, without bound.
    port = await _router(routers, static_file)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
        answers = [await read_response(reader) for _ in range(MAX_PIPELINE + 1)]
        assert all(a.status == 200 for a in answers)
        # The one being handled and MAX_PIPELINE waiting; the last says so and the connection ends.
        assert [a.headers.get("connection") for a in answers][-2:] == [None, "close"]
        assert await closed_by_peer(reader, 5.0) == b""
    finally:
        writer.close()
    # A pipeline within the bound is served whole, and the connection stays.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 10)
        answers = [await read_response(reader) for _ in range(10)]
        assert all(a.status == 200 and "connection" not in a.headers for a in answers)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader)).status == 200
    finally:
        writer.close()


async def test_two_authorization_fields_are_400(routers: RouterFactory, static_file: StaticFile) -> None:
    # The first one won: a proxy in front that checked the second would be bypassed.
    port = await _router(routers, static_file)
    for second in (b"Bearer " + KEY.encode(), b"Bearer nope"):
        resp = await raw_exchange(
            port,
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nAuthorization: "
            + second
            + b"\r\n\r\n",
        )
        assert resp.status == 400 and "Authorization" in resp.json()["error"]["message"], resp.body
    ok = await raw_exchange(
        port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    )
    assert ok.status == 200


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /health HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),  # two
        (b"GET /health HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /health HTTP/1.0\r\n\r\n", 200),  # HTTP/1.0 needs none
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GET /health HTTP/0.9\r\nHost: x\r\n\r\n", 505),
    ],
    ids=["no-host", "two-hosts", "two-hosts-1.0", "1.0-no-host", "http-2.0", "http-0.9"],
)
async def test_host_and_version_are_checked(
    routers: RouterFactory, static_file: StaticFile, request_bytes: bytes, status: int
) -> None:
    port = await _router(routers, static_file)
    resp = await raw_exchange(port, request_bytes)
    assert resp.status == status, (resp.status, resp.body)


async def test_a_transfer_encoding_not_ending_in_chunked_is_400_at_once(
    routers: RouterFactory, static_file: StaticFile
) -> None:
    # llhttp refuses it only after the head: the handler had started, answered 405, and the
    # connection lingered 5 s for a body that has no end.
    port = await _router(routers, static_file)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        t = time.monotonic()
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\nabc")
        resp = await read_response(reader)
        assert resp.status == 400 and "Transfer-Encoding" in resp.json()["error"]["message"], resp.body
        assert await closed_by_peer(reader, 5.0) == b""
        assert time.monotonic() - t < 2.0
    finally:
        writer.close()


@pytest.mark.slow
async def test_an_http_1_0_client_is_not_sent_100_continue(
    routers: RouterFactory, static_file: StaticFile
) -> None:
    port = await _router(routers, static_file)
    for version, interim in ((b"1.0", False), (b"1.1", True)):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/"
                + version
                + b"\r\nHost: x\r\nAuthorization: Bearer "
                + KEY.encode()
                + b"\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
            )
            if interim:
                assert (
                    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                    == b"HTTP/1.1 100 Continue\r\n\r\n"
                )
            else:
                # Nothing comes before the body is sent: no interim answer.
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
            writer.write(b"{}")
            resp = await read_response(reader)
            assert resp.status == 400, resp.body  # no model: but the body was read
        finally:
            writer.close()


FORWARDED = (
    b"X-Forwarded-Host: attacker.example\r\nX-Forwarded-Proto: https\r\nX-Forwarded-Prefix: /steal\r\n"
)


async def test_forwarded_headers_are_believed_only_from_trusted_proxies_and_the_page_is_not_stored(
    routers: RouterFactory, static_file: StaticFile
) -> None:
    # They were believed from any client, and the page had no Cache-Control: a shared cache could keep
    # "send your key to attacker.example" for everyone.
    files = static_file({"m1": [NOWHERE]}, keys=[{"name": "k", "hash": hash_key(KEY)}])
    # The test's client is on loopback: trusted by default, so "anyone" trusts no one here.
    anyone = await routers(files, trusted_proxies="")
    proxied = await routers(files, trusted_proxies="10.0.0.0/8, 127.0.0.1")
    elsewhere = await routers(files, trusted_proxies="10.0.0.0/8")
    ask = b"GET / HTTP/1.1\r\nHost: gw.example:8080\r\n" + FORWARDED + b"\r\n"
    page = await raw_exchange(anyone.port, ask)
    assert page.status == 200 and page.headers["cache-control"] == "no-store", page.headers
    assert b"attacker.example" not in page.body and b"http://gw.example:8080/v1" in page.body
    behind = await raw_exchange(proxied.port, ask)
    assert behind.status == 200 and behind.headers["cache-control"] == "no-store"
    assert b"https://attacker.example/steal/v1" in behind.body
    other = await raw_exchange(elsewhere.port, ask)
    assert b"attacker.example" not in other.body and b"http://gw.example:8080/v1" in other.body


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    from pydantic import ValidationError

    from llmgw_router.settings import RouterSettings

    assert RouterSettings(trusted_proxies="10.0.0.0/8,::1").trusted_proxies == ["10.0.0.0/8", "::1"]
    assert RouterSettings(trusted_proxies="").trusted_proxies == []
    assert RouterSettings().trusted_proxies == ["127.0.0.1", "::1"]
    with pytest.raises(ValidationError, match="not an IP address or network"):
        RouterSettings(trusted_proxies="proxy.example")


async def test_a_coding_before_chunked_is_501(routers: RouterFactory, static_file: StaticFile) -> None:
    # Found by the differential test: llhttp takes "gzip, chunked", and the gzip bytes would be the body.
    port = await _router(routers, static_file)
    resp = await raw_exchange(
        port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    )
    assert resp.status == 501 and resp.headers["connection"] == "close", (resp.status, resp.body)


async def test_a_body_in_one_byte_chunks_is_read_whole(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    # Past 64 pieces the body is gathered in one buffer (a piece each would cost 30 times its data).
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 2})
    chunked = b"".join(b"1\r\n%s\r\n" % bytes([c]) for c in body.encode()) + b"0\r\n\r\n"
    resp = await raw_exchange(
        r.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked,
    )
    assert resp.status == 200 and resp.json()["usage"]["completion_tokens"] == 2, resp.body
