"""Traces through the router (issue 34): the trace context an engine is sent, and the spans the router
records. Real routers and engines on sockets; the spans land in the OpenTelemetry SDK's own in-memory
exporter (the receiver over OTLP is tests/router/test_router_tracing_phoenix.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from llmgw_common.traceparent import parse_traceparent
from llmgw_router.service import Router
from llmgw_router.settings import RouterSettings
from llmgw_router.tracing import RouterTracing
from llmgw_runtime.tracing import Tracer
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, RouterFactory, StaticFile

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{SPAN}-01"
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m1-from-engine",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
}


class Engine:
    """An engine that answers one chat completion and keeps the trace headers each request came with."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, str | None]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> Engine:
        async def chat(request: web.Request) -> web.Response:
            await request.read()
            self.seen.append((request.headers.get("traceparent"), request.headers.get("tracestate")))
            return web.json_response(ANSWER)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = await Engine().start()
    yield e
    await e.stop()


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    yield InMemorySpanExporter()


@pytest.fixture
async def traced(
    exporter: InMemorySpanExporter, static_file: StaticFile, tmp_path: Any
) -> AsyncIterator[Any]:
    """Start a static router whose spans go to ``exporter`` (the SDK's processor, sampling all)."""
    started: list[Router] = []

    async def make(
        models: dict[str, list[str]], static: dict[str, Any] | None = None, ratio: float = 1.0, **kw: Any
    ) -> Router:
        import yaml

        path = tmp_path / f"static-{len(started)}.yaml"
        doc = static_file(models, **(static or {"auth": False}))
        for m in doc["models"]:
            m.update((static or {}).get("profile", {}))
        doc.pop("profile", None)
        path.write_text(yaml.safe_dump(doc))
        r = Router(RouterSettings(port=0, static_file=str(path), router_id=f"tr{len(started)}", **kw))
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        r.ctx.tracing = RouterTracing(Tracer(provider, provider.get_tracer("test")), ratio)
        await r.start()
        started.append(r)
        return r

    yield make
    for r in started:
        await r.stop()


async def _post(port: int, headers: dict[str, str], body: dict[str, Any] = CHAT) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)


def _by_kind(spans: tuple[ReadableSpan, ...], kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.kind is kind]


# ---------------------------------------------------------------- tracing off


async def test_off_a_valid_traceparent_reaches_the_engine_made_anew(
    routers: RouterFactory, static_file: StaticFile, engine: Engine
) -> None:
    r = await routers(static_file({"m1": [engine.url]}, auth=False))
    assert r.ctx.tracing is None
    # Optional whitespace around it, a later version's longer form: the engine gets version 00.
    longer = f"01-{TRACE}-{SPAN}-01-future"
    for sent in (GOOD, f" {GOOD} ", longer):
        status, _ = await _post(r.port, {"traceparent": sent, "tracestate": "a=1, b=2"})
        assert status == 200
    assert engine.seen == [(GOOD, "a=1,b=2")] * 3


@pytest.mark.parametrize(
    "bad",
    [
        GOOD.upper(),
        f"ff-{TRACE}-{SPAN}-01",
        f"00-{'0' * 32}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-01-" + "x" * 300,
        "not a traceparent",
    ],
)
async def test_off_a_malformed_traceparent_is_never_forwarded_nor_refused(
    routers: RouterFactory, static_file: StaticFile, engine: Engine, bad: str
) -> None:
    r = await routers(static_file({"m1": [engine.url]}, auth=False))
    status, body = await _post(r.port, {"traceparent": bad, "tracestate": "a=1"})
    assert status == 200, body
    # Nothing at all: a tracestate without its traceparent means nothing either.
    assert engine.seen == [(None, None)]


async def test_off_no_traceparent_sends_none(
    routers: RouterFactory, static_file: StaticFile, engine: Engine
) -> None:
    r = await routers(static_file({"m1": [engine.url]}, auth=False))
    assert (await _post(r.port, {}))[0] == 200
    assert engine.seen == [(None, None)]


@pytest.mark.slow
def test_off_the_sdk_is_never_imported() -> None:
    """A router with tracing off never loads the OpenTelemetry SDK nor its exporter (a process of its
    own: this one has them loaded by the tests)."""
    code = (
        "import sys\n"
        "from llmgw_router.service import Router\n"
        "from llmgw_router.settings import RouterSettings\n"
        "r = Router(RouterSettings(port=0, router_id='x'), follow_bus=False)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow
def test_on_without_the_sdk_is_a_clear_startup_error() -> None:
    """otlp_traces_endpoint set where the tracing extra is missing: `llmgw router` refuses to start and
    says what to install, no traceback (the SDK hidden from a child process)."""
    code = (
        "import sys\n"
        "sys.modules['opentelemetry.sdk'] = None\n"
        "sys.argv = ['llmgw', 'router', '--port', '0']\n"
        "from llmgw_cli.main import main\n"
        "main()\n"
    )
    env = dict(os.environ, LLMGW_OTLP_TRACES_ENDPOINT="http://127.0.0.1:9/v1/traces")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: otlp_traces_endpoint is set but"), out.stderr
    assert "pip install 'llmgw[tracing]'" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------- tracing on


async def test_on_one_server_span_and_one_client_span_under_the_clients_trace(
    traced: Any, engine: Engine, exporter: InMemorySpanExporter
) -> None:
    r = await traced({"m1": [engine.url]})
    status, _ = await _post(r.port, {"traceparent": GOOD, "tracestate": "vendor=x"})
    assert status == 200
    spans = exporter.get_finished_spans()
    (server,) = _by_kind(spans, SpanKind.SERVER)
    (client,) = _by_kind(spans, SpanKind.CLIENT)
    # The client's trace, the client's span as the parent.
    assert server.context is not None and client.context is not None and server.parent is not None
    assert f"{server.context.trace_id:032x}" == TRACE
    assert f"{server.parent.span_id:016x}" == SPAN
    assert client.parent is not None and client.parent.span_id == server.context.span_id
    # The engine was sent the CLIENT span as its parent, and the client's tracestate.
    ((tp, ts),) = engine.seen
    parent = parse_traceparent(tp)
    assert parent is not None and parent.trace_id == server.context.trace_id
    assert parent.span_id == client.context.span_id and parent.sampled
    assert ts == "vendor=x"
    # GenAI conventions.
    assert server.name == "POST /v1/chat/completions" and client.name == "chat m1"
    for s in (server, client):
        a = s.attributes or {}
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == "m1"
        assert a["gen_ai.response.model"] == "m1-from-engine"
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (7, 2)
        assert a["http.response.status_code"] == 200
        assert "error.type" not in a
    assert (client.attributes or {})["server.address"] == "127.0.0.1"


@pytest.mark.parametrize("bad", [GOOD.upper(), f"ff-{TRACE}-{SPAN}-01", "x" * 1000])
async def test_on_a_malformed_traceparent_starts_a_new_trace(
    traced: Any, engine: Engine, exporter: InMemorySpanExporter, bad: str
) -> None:
    r = await traced({"m1": [engine.url]})
    status, _ = await _post(r.port, {"traceparent": bad})
    assert status == 200
    (server,) = _by_kind(exporter.get_finished_spans(), SpanKind.SERVER)
    assert server.parent is None and server.context is not None
    assert f"{server.context.trace_id:032x}" != TRACE
    assert (server.attributes or {})["llmgw.traceparent.rejected"] is True
    ((tp, _),) = engine.seen
    assert tp != bad and tp is not None
    p = parse_traceparent(tp)
    assert p is not None and p.trace_id == server.context.trace_id


async def test_on_a_request_without_one_starts_a_trace(
    traced: Any, engine: Engine, exporter: InMemorySpanExporter
) -> None:
    r = await traced({"m1": [engine.url]})
    assert (await _post(r.port, {}))[0] == 200
    (server,) = _by_kind(exporter.get_finished_spans(), SpanKind.SERVER)
    assert server.parent is None
    assert (server.attributes or {})["llmgw.traceparent.rejected"] is False
    assert engine.seen[0][0] is not None


async def test_on_a_retry_is_an_event_and_each_attempt_a_span(
    traced: Any, engine: Engine, exporter: InMemorySpanExporter, port: Any
) -> None:
    dead = f"http://127.0.0.1:{port()}"  # nothing listens: the connection is refused
    r = await traced({"m1": [dead, engine.url]})
    ep_good = next(e for e in r.ctx.pool.by_key.values() if e.url == engine.url)
    ep_good.in_flight += 100  # the dead endpoint is chosen first
    try:
        assert (await _post(r.port, {"traceparent": GOOD}))[0] == 200
    finally:
        ep_good.in_flight -= 100
    spans = exporter.get_finished_spans()
    (server,) = _by_kind(spans, SpanKind.SERVER)
    first, second = sorted(_by_kind(spans, SpanKind.CLIENT), key=lambda s: s.start_time or 0)
    assert (first.attributes or {})["error.type"] == "connection_refused"
    assert (first.attributes or {})["llmgw.attempt"] == 1 and (second.attributes or {})["llmgw.attempt"] == 2
    assert "error.type" not in (second.attributes or {})
    retries = [e for e in server.events if e.name == "llmgw.retry"]
    assert len(retries) == 1 and (retries[0].attributes or {})["llmgw.attempt"] == 2
    # Only the attempt that reached the engine was seen there, with its own span as the parent.
    ((tp, _),) = engine.seen
    p = parse_traceparent(tp)
    assert p is not None and second.context is not None and p.span_id == second.context.span_id


async def test_on_a_refusal_is_an_event_and_the_status(
    traced: Any, engine: Engine, exporter: InMemorySpanExporter
) -> None:
    r = await traced({"m1": [engine.url]})
    status, _ = await _post(r.port, {"traceparent": GOOD}, {**CHAT, "model": "nope"})
    assert status == 404
    (server,) = _by_kind(exporter.get_finished_spans(), SpanKind.SERVER)
    assert (server.attributes or {})["http.response.status_code"] == 404
    (ev,) = [e for e in server.events if e.name == "llmgw.refused"]
    assert "nope" in str((ev.attributes or {})["llmgw.reason"])
    assert engine.seen == []


async def test_on_a_streamed_answer_names_the_model_and_usage(
    traced: Any, engines: EngineFactory, exporter: InMemorySpanExporter
) -> None:
    sim = await engines("m1")
    r = await traced({"m1": [sim.url]})
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body) as resp:
            raw = await resp.read()
    assert resp.status == 200 and raw.endswith(b"data: [DONE]\n\n")
    last = json.loads(raw.split(b"\n\n")[-3].removeprefix(b"data: "))
    (client,) = _by_kind(exporter.get_finished_spans(), SpanKind.CLIENT)
    a = client.attributes or {}
    assert a["gen_ai.response.model"] == "m1"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        last["usage"]["prompt_tokens"],
        last["usage"]["completion_tokens"],
    )


KEY = "llmgw-test-" + "k" * 32


@pytest.mark.slow
@pytest.mark.parametrize("keyed", [False, True])
async def test_on_a_wait_at_the_models_gate_is_an_event(
    traced: Any, engines: EngineFactory, exporter: InMemorySpanExporter, keyed: bool
) -> None:
    """A model at its concurrency limit: the second request waits in its queue, fair across keys by
    weight (a keyed request) or in plain admission (auth off)."""
    sim = await engines("m1", ttft_ms=400, tokens_per_s=1000)
    static: dict[str, Any] = {"profile": {"max_concurrency": 1}}
    headers: dict[str, str] = {}
    if keyed:
        static["keys"] = [{"name": "tenant", "hash": hashlib.sha256(KEY.encode()).hexdigest()}]
        headers["Authorization"] = f"Bearer {KEY}"
    else:
        static["auth"] = False
    r = await traced({"m1": [sim.url]}, static)
    results = await asyncio.gather(*(_post(r.port, headers) for _ in range(2)))
    assert [st for st, _ in results] == [200, 200], results
    servers = _by_kind(exporter.get_finished_spans(), SpanKind.SERVER)
    assert len(servers) == 2
    name = "llmgw.fair_queue.wait" if keyed else "llmgw.admission.wait"
    waits = [e for s in servers for e in s.events if e.name.endswith(".wait")]
    assert [e.name for e in waits] == [name], waits
    a = waits[0].attributes or {}
    waited = a["llmgw.waited_s"]
    assert isinstance(waited, float) and waited >= 0.2  # the first request's time at the engine, roughly
    assert a["llmgw.concurrency_limit"] == 1
    assert ("llmgw.key_id" in a) is keyed


async def test_on_a_request_not_sampled_has_no_span_and_its_engine_a_new_unsampled_trace(
    traced: Any, engine: Engine, exporter: InMemorySpanExporter
) -> None:
    r = await traced({"m1": [engine.url]}, ratio=0.0)
    for _ in range(3):
        assert (await _post(r.port, {}))[0] == 200
    assert exporter.get_finished_spans() == ()
    sent = [parse_traceparent(tp) for tp, _ in engine.seen]
    assert all(p is not None and not p.sampled for p in sent)
    assert len({p.trace_id for p in sent if p is not None}) == 3  # a trace each


async def test_on_the_clients_sampled_flag_decides_for_its_request(
    traced: Any, engine: Engine, exporter: InMemorySpanExporter
) -> None:
    r = await traced({"m1": [engine.url]}, ratio=0.0)
    assert (await _post(r.port, {"traceparent": GOOD}))[0] == 200  # sampled: recorded whatever the ratio
    (server,) = _by_kind(exporter.get_finished_spans(), SpanKind.SERVER)
    assert server.context is not None and f"{server.context.trace_id:032x}" == TRACE
    exporter.clear()
    r2 = await traced({"m1": [engine.url]}, ratio=1.0)
    unsampled = f"00-{TRACE}-{SPAN}-00"
    assert (await _post(r2.port, {"traceparent": unsampled, "tracestate": "a=1"}))[0] == 200
    assert exporter.get_finished_spans() == ()
    # Not recorded: the engine has the client's context as it came.
    assert engine.seen[-1] == (unsampled, "a=1")


async def test_two_traceparent_headers_are_none(
    routers: RouterFactory, static_file: StaticFile, engine: Engine
) -> None:
    """W3C Trace Context: several traceparent headers make it invalid; nothing is passed on."""
    r = await routers(static_file({"m1": [engine.url]}, auth=False))
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    body = json.dumps(CHAT).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"traceparent: {GOOD}\r\nTraceparent: {GOOD}\r\n".encode()
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    head = await reader.readline()
    writer.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    assert engine.seen == [(None, None)]


async def test_on_a_quota_refusal_is_an_event(
    traced: Any, engine: Engine, exporter: InMemorySpanExporter
) -> None:
    """A key over its requests per minute: 429 at once, and the request's span says which limit."""
    from llmgw_common.messages import ApiKeyRecord, KeyLimits
    from llmgw_runtime.apikeys import hash_key

    static = {"keys": [{"name": "other", "hash": hashlib.sha256(b"x" * 40).hexdigest()}]}
    r = await traced({"m1": [engine.url]}, static)
    r.ctx.keys.put(
        ApiKeyRecord(id="k-limited", name="limited", hash=hash_key(KEY), created=0.0, limits=KeyLimits(rpm=1))
    )
    auth = {"Authorization": f"Bearer {KEY}", "traceparent": GOOD}
    assert (await _post(r.port, auth))[0] == 200
    assert (await _post(r.port, auth))[0] == 429
    servers = sorted(
        _by_kind(exporter.get_finished_spans(), SpanKind.SERVER), key=lambda s: s.start_time or 0
    )
    assert [(s.attributes or {})["http.response.status_code"] for s in servers] == [200, 429]
    (ev,) = [e for e in servers[1].events if e.name == "llmgw.quota.refused"]
    assert (ev.attributes or {})["llmgw.key_id"] == "k-limited"
    assert "request" in str((ev.attributes or {})["llmgw.reason"])
    assert not [e for e in servers[0].events if e.name == "llmgw.quota.refused"]
    assert len(engine.seen) == 1  # the refused one never reached it


async def test_on_a_client_gone_mid_stream_ends_the_span_so(
    traced: Any, engines: EngineFactory, exporter: InMemorySpanExporter
) -> None:
    sim = await engines("m1", ttft_ms=10, tokens_per_s=50)
    r = await traced({"m1": [sim.url]})
    body = {**CHAT, "max_tokens": 200, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readany()  # the first events, then the client hangs up
    await eventually(
        lambda: len(_by_kind(exporter.get_finished_spans(), SpanKind.SERVER)) == 1,
        timeout=10.0,
        what="the request's span to end",
    )
    (server,) = _by_kind(exporter.get_finished_spans(), SpanKind.SERVER)
    assert (server.attributes or {})["error.type"] == "client_gone"
    assert "http.response.status_code" not in (server.attributes or {})
