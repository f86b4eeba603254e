"""The official openai client against a router in static mode, in front of simulated engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from llmgw_router.service import Router
from llmgw_runtime.apikeys import generate_key, hash_key
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, PortFactory, RouterFactory, StaticFile

# What the ``setup`` fixture yields: the router, an openai client with KEY, and the /v1 base URL.
Setup = tuple[Router, openai.AsyncOpenAI, str]

KEY = generate_key()
LIMITED = generate_key()


@pytest.fixture
async def setup(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile, port: PortFactory
) -> AsyncIterator[Setup]:
    e1 = await engines("m1")
    e2 = await engines("m1")
    emb = await engines("emb")
    static = static_file(
        {"m1": [e1.url, e2.url], "emb": [emb.url], "down": []},
        keys=[
            {"name": "all", "hash": hash_key(KEY)},
            {"name": "lim", "hash": hash_key(LIMITED), "models": ["emb"]},
        ],
    )
    r = await routers(static, admin_port=port(), max_body_bytes=4096)
    base = f"http://127.0.0.1:{r.port}/v1"
    client = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0)
    yield r, client, base
    await client.close()


def _code(e: openai.APIStatusError) -> object:
    """The ``code`` of an error answer's body (openai types the body as ``object``)."""
    body = e.body
    assert isinstance(body, dict), body
    return body.get("code")


async def test_chat_completions_embeddings_and_models(setup: Setup) -> None:
    r, client, _ = setup
    chat = await client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens == 5
    comp = await client.completions.create(model="m1", prompt="once upon", max_tokens=3)
    assert comp.choices[0].text and comp.usage is not None and comp.usage.completion_tokens == 3
    emb = await client.embeddings.create(model="emb", input=["a", "b"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    models = sorted(m.id for m in (await client.models.list()).data)
    assert models == ["down", "emb", "m1"]
    # Usage is counted per key id and model, from the answers' usage.
    rep = r.ctx.usage.report("x", 0.0).usage
    assert rep["static-0"]["m1"][0] == 2 and rep["static-0"]["m1"][2] == 8
    assert r.ctx.metrics.in_flight == 0


async def test_streaming_is_passed_through_and_usage_counted(setup: Setup) -> None:
    r, client, base = setup
    stream = await client.chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text and usage is not None and usage.completion_tokens == 7
    assert r.ctx.usage.usage["static-0"]["m1"][2] == 7
    # Byte for byte: the router's SSE body equals the engine's for the same deterministic request.
    body = {"model": "m1", "prompt": "x", "max_tokens": 4, "stream": True}
    engine_url = r.ctx.pool.by_model["m1"][0].url
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{base}/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp:
            via = await resp.read()
            assert resp.headers["Content-Type"].startswith("text/event-stream")
        async with s.post(f"{engine_url}/v1/completions", json=body) as resp:
            direct = await resp.read()
    strip = [json.loads(line[6:]) for line in via.split(b"\n\n") if line.startswith(b"data: {")]
    strip_d = [json.loads(line[6:]) for line in direct.split(b"\n\n") if line.startswith(b"data: {")]
    for c in strip + strip_d:  # ids and timestamps differ between two requests; the framing must not
        c.pop("id", None)
        c.pop("created", None)
    assert strip == strip_d and via.endswith(b"data: [DONE]\n\n")


async def test_error_cases(setup: Setup) -> None:
    r, client, base = setup
    async with openai.AsyncOpenAI(base_url=base, api_key="llmgw-nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e401:
            await bad.models.list()
    assert e401.value.status_code == 401 and _code(e401.value) == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e404:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert _code(e404.value) == "model_not_found"
    with pytest.raises(openai.InternalServerError) as e503:
        await client.chat.completions.create(model="down", messages=[{"role": "user", "content": "x"}])
    assert e503.value.status_code == 503 and "no ready replica" in e503.value.message
    assert e503.value.response.headers["Retry-After"]
    with pytest.raises(openai.APIStatusError) as e413:
        await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x" * 5000}])
    assert e413.value.status_code == 413 and _code(e413.value) == "request_too_large"
    # A key limited to one model: other models are 404 (as if absent), and /v1/models lists only its own.
    lim = openai.AsyncOpenAI(base_url=base, api_key=LIMITED, max_retries=0)
    assert [m.id for m in (await lim.models.list()).data] == ["emb"]
    with pytest.raises(openai.NotFoundError):
        await lim.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
    await lim.close()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        async with s.post(f"{base}/chat/completions", data=b"{not json") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
        async with s.post(f"{base}/chat/completions", json={"messages": []}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "model"
        async with s.post(f"{base}/chat/completions", json=["m1"]) as resp:
            assert resp.status == 400
        async with s.get(f"{base}/nothing-here") as resp:
            assert resp.status == 404 and "error" in await resp.json()
        # A known path with another method: 405 in the same shape, with the methods it has (RFC 9110).
        for method, path, allow in (
            ("GET", "/chat/completions", "POST"),
            ("DELETE", "/embeddings", "POST"),
            ("POST", "/models", "GET, HEAD"),
            ("PUT", "/models/m1", "GET, HEAD"),
            ("DELETE", "/responses/resp_x", "GET"),
            ("GET", "/responses/resp_x/cancel", "POST"),
        ):
            async with s.request(method, f"{base}{path}") as resp:
                assert resp.status == 405 and resp.headers.get("Allow") == allow, (path, resp.headers)
                assert (await resp.json())["error"]["code"] == "method_not_allowed"
    # The key is checked before the path is: without one, an unknown path or method is 401 too.
    async with aiohttp.ClientSession() as s:
        for method, path in (("GET", "/nothing-here"), ("GET", "/chat/completions")):
            async with s.request(method, f"{base}{path}") as resp:
                assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        # Chunked body over the limit (no Content-Length to refuse early).
        async def gen() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b"x" * 1000

        async with s.post(f"{base}/chat/completions", data=gen()) as resp:
            assert resp.status == 413
    # A chunked body over the limit that arrives whole with its headers (one write): still 413.
    host, port = "127.0.0.1", r.port
    reader, writer = await asyncio.open_connection(host, port)
    payload = b"x" * 6000
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + f"{len(payload):x}\r\n".encode()
        + payload
        + b"\r\n0\r\n\r\n"
    )
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer
    # An empty body (Content-Length: 0) is not JSON: 400.
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        async with s.post(f"{base}/chat/completions", data=b"") as resp:
            assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]
    assert r.ctx.metrics.in_flight == 0
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{r.admin_port}/metrics") as resp:
        text = await resp.text()
    assert 'llmgw_router_requests_total{model="down",status="503"} 1.0' in text
    assert 'llmgw_router_requests_total{model="-",status="404"}' in text
    assert "llmgw_router_breaker_state" in text and "llmgw_router_queue_depth" in text


async def test_full_queue_is_429_with_retry_after(engines: EngineFactory, routers: RouterFactory) -> None:
    slow = await engines("m1", ttft_ms=2000, tokens_per_s=1000)
    static = {
        "auth": False,
        "models": [
            {
                "name": "m1",
                "endpoints": [slow.url],
                "max_concurrency": 1,
                "max_queue": 1,
                "queue_timeout_s": 10,
            }
        ],
    }
    r = await routers(static)
    base = f"http://127.0.0.1:{r.port}/v1"
    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
    body: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    # The two requests that fill the slot and the queue are cancelled later: aiohttp closes its
    # connection on cancel (httpx under anyio leaves a transport for the garbage collector).
    raw = aiohttp.ClientSession()

    async def hold() -> None:
        async with raw.post(f"{base}/chat/completions", json=body) as resp:
            await resp.read()

    first = asyncio.create_task(hold())
    second = asyncio.create_task(hold())
    gate = r.ctx.gates.by_model
    await eventually(
        lambda: "m1" in gate and gate["m1"].queued == 1,
        timeout=2.0,
        every=0.01,
        what="the second request to queue behind the first",
    )
    assert gate["m1"].active == 1 and gate["m1"].queued == 1
    with pytest.raises(openai.RateLimitError) as e429:
        await client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    assert e429.value.response.headers["Retry-After"] == "1"
    assert "queue of 1 is full" in e429.value.message
    first.cancel()
    second.cancel()
    for t in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await t
    await eventually(
        lambda: r.ctx.metrics.in_flight == 0 and gate["m1"].active == 0,
        timeout=3.0,
        every=0.01,
        what="the cancelled requests to leave the router and the gate",
    )
    assert r.ctx.metrics.in_flight == 0 and gate["m1"].active == 0 and gate["m1"].queued == 0
    await client.close()
    await raw.close()


async def test_landing_page_and_health_need_no_key_and_carry_no_data(setup: Setup) -> None:
    r, _, base = setup
    root = base.removesuffix("/v1")
    async with aiohttp.ClientSession() as s:
        hdrs = {
            "X-Forwarded-Proto": "https",
            "X-Forwarded-Host": "gw.example.org",
            "X-Forwarded-Prefix": "/llm",
        }
        async with s.get(root + "/", headers=hdrs) as resp:
            assert resp.status == 200
            page = await resp.text()
        async with s.get(root + "/?x=1") as resp:
            assert resp.status == 200
        for path in ("/health", "/healthz"):
            async with s.get(root + path) as resp:
                assert resp.status == 200
        for path in ("/v1/models", "//", "/v1/", "/healthz/../v1/models", "/health/", "/index.html"):
            async with s.get(root + path) as resp:
                assert resp.status == 401, path
        async with s.get(root + "/", headers={"X-Forwarded-Host": "<img src=x onerror=alert(1)>"}) as resp:
            evil = await resp.text()
        # Forwarded headers never decide anything: they cannot make a path exempt.
        spoof = {
            "X-Forwarded-Prefix": "/",
            "X-Forwarded-Host": "localhost",
            "X-Original-URL": "/",
            "X-Forwarded-Uri": "/health",
            "X-Rewrite-URL": "/",
        }
        for path in ("/v1/models", "/v1/chat/completions"):
            async with s.request(
                "GET" if path.endswith("models") else "POST", root + path, headers=spoof
            ) as resp:
                assert resp.status == 401, path
    assert "https://gw.example.org/llm/v1" in page and "curl" in page and "from openai import OpenAI" in page
    for secret in (
        "m1",
        "emb",
        "down",
        "static-",
        "127.0.0.1:",
        *(e.url for e in r.ctx.pool.by_key.values()),
    ):
        assert secret not in page, secret
    assert "<img" not in evil
