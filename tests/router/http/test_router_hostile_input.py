"""Hostile bytes on the wire: a non-UTF-8 API key, JSON nested 100,000 deep.

Each is a 4xx with an OpenAI-style body naming the problem, and at most one log line without a
traceback (a traceback per request is a log flood anyone can cause). Raw sockets, so the bytes are
exactly what a hostile client would send.
"""

from __future__ import annotations

import logging

import pytest

from llmgw_runtime.apikeys import hash_key
from tests.router.router_helpers import EngineFactory, RouterFactory, StaticFile, raw_exchange

# Fixed, not generate_key(): it is part of a test id, which must be the same in every xdist worker.
KEY = "llmgw-hostile-input-test-key-WBvXaHq1Jc7dK2sLmN4pQ5rT6uV8yZ0"


def _no_traceback_and_at_most_one_line(caplog: pytest.LogCaptureFixture) -> None:
    # Not asyncio's debug-mode note of a slow loop step: a loaded box's, not the input's.
    records = [
        r
        for r in caplog.records
        if r.name.startswith(("llmgw", "aiohttp", "asyncio")) and r.msg != "Executing %s took %.3f seconds"
    ]
    assert [r for r in records if r.exc_info or r.levelno >= logging.ERROR] == [], [
        r.getMessage() for r in records
    ]
    assert len([r for r in records if r.levelno >= logging.WARNING]) <= 1, [r.getMessage() for r in records]


@pytest.mark.parametrize(
    "header",
    [
        b"Authorization: Bearer \xff\xfe\x80key",
        b"Authorization: Bearer llmgw-\xc3\x28",  # a truncated two-byte sequence
        b"X-Api-Key: \xff" + KEY.encode(),
    ],
    # The key is random per process: an id holding it would differ between xdist workers.
    ids=["bearer-invalid-bytes", "bearer-truncated-sequence", "x-api-key-prefixed"],
)
@pytest.mark.slow
async def test_non_utf8_api_key_is_401_without_a_traceback(
    engines: EngineFactory,
    routers: RouterFactory,
    static_file: StaticFile,
    caplog: pytest.LogCaptureFixture,
    header: bytes,
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, keys=[{"name": "k", "hash": hash_key(KEY)}]))
    caplog.set_level(logging.DEBUG)
    for path in (b"/v1/models", b"/v1/chat/completions"):
        method = b"POST" if b"chat" in path else b"GET"
        resp = await raw_exchange(
            r.port,
            method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n" + header + b"\r\nContent-Length: 2\r\n\r\n{}",
        )
        assert resp.status == 401, (path, resp.status, resp.body)
        err = resp.json()["error"]
        assert err["code"] == "invalid_api_key" and "UTF-8" in err["message"], err
    _no_traceback_and_at_most_one_line(caplog)
    # The router still serves a good key afterwards.
    ok = await raw_exchange(
        r.port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    )
    assert ok.status == 200, ok.body


@pytest.mark.parametrize("depth", [100_000, 10_000])
async def test_deeply_nested_json_is_400_without_a_traceback(
    engines: EngineFactory,
    routers: RouterFactory,
    static_file: StaticFile,
    caplog: pytest.LogCaptureFixture,
    depth: int,
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    caplog.set_level(logging.DEBUG)
    for body in (b"[" * depth + b"]" * depth, b'{"model": "m1", "x": ' + b"[" * depth + b"]" * depth + b"}"):
        resp = await raw_exchange(
            r.port,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body,
        )
        assert resp.status == 400, (resp.status, resp.body[:300])
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and "nested too deeply" in err["message"], err
    assert r.ctx.metrics.requests_count("-", 400) == 2
    _no_traceback_and_at_most_one_line(caplog)
    assert r.ctx.metrics.in_flight == 0


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET /v1/models/\xe2\x82 HTTP/1.1",
        b"GET /v1/\xff HTTP/1.1",
        b"POST /v1/chat/completions HTTP/1.1\x01",
    ],
)
async def test_bytes_that_are_not_http_are_400_without_a_traceback(
    engines: EngineFactory,
    routers: RouterFactory,
    static_file: StaticFile,
    caplog: pytest.LogCaptureFixture,
    request_line: bytes,
) -> None:
    eng = await engines("m1")
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    caplog.set_level(logging.DEBUG)
    resp = await raw_exchange(r.port, request_line + b"\r\nHost: x\r\n\r\n")
    assert resp.status == 400, resp.body
    _no_traceback_and_at_most_one_line(caplog)
    # One DEBUG line from the router's HTTP server (it was aiohttp.server's before the router had its own).
    assert len([x for x in caplog.records if x.name == "llmgw.router.http"]) == 1
