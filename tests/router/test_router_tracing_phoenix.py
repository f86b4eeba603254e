"""One held, continued request as one trace in a real receiver (issue 34): Arize Phoenix from the package
index (``make otel-deps``; skipped without it) takes the spans over OTLP/HTTP and is read back by its
REST API.

The request comes for a cold model: the router holds it and asks a wake of the control plane's own
wake responder (real NATS, its context in the headers), the routing table then brings one replica, the
stream starts there, a second replica appears and the first engine is killed mid-stream: the router
continues the stream on the second. Every step is an event or a span of the client's trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_common.subjects import Subjects
from llmgw_controlplane.wakes import WakeResponder
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.tracing import start_tracing
from llmgw_sim.options import SimOptions
from tests.kit.phoenix import Phoenix, phoenix  # noqa: F401 (the fixture)
from tests.kit.poll import eventually
from tests.router.router_helpers import (
    EngineProcs,
    RouterFactory,
    start_engine_process,
    stop_engine_processes,
)
from tests.router.routing.test_router_holding import Routing

pytest.importorskip("opentelemetry.sdk.trace")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOKENS = 300  # 5 s at 60 tokens/s: still streaming when the engine is killed, on a loaded machine too


@pytest.fixture
def engine_procs() -> Iterator[EngineProcs]:
    procs: EngineProcs = []
    try:
        for _ in range(2):
            opts = SimOptions(port=0, model="m1", ttft_ms=20, tokens_per_s=60, slots=8)
            procs.append(start_engine_process("m1", opts))
        yield procs
    finally:
        stop_engine_processes(procs)


def _events(span: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(e["name"], e["attributes"]) for e in span["events"]]


async def test_a_held_continued_request_is_one_trace_in_phoenix(
    phoenix: Phoenix,  # noqa: F811
    nats_server: NatsServer,
    nc: NATS,
    prefix: str,
    routers: RouterFactory,
    engine_procs: EngineProcs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog(wake_timeout_s=60)
    await routing.endpoints(cold=("m1",))

    # The control plane's wake responder, exporting its own spans; it answers "waking".
    asked: list[WakeRequest] = []

    def answer(req: WakeRequest) -> WakeReply:
        asked.append(req)
        return WakeReply(model=req.model, state=WakeState.WAKING)

    cp_tracer = start_tracing("llmgw-controlplane", "cp-test", phoenix.traces_endpoint, 1.0)
    wakes = WakeResponder(
        Subjects(prefix).all_wake(),
        answer,
        bus.DropLog(logging.getLogger("test")),
        version=lambda: 0,
        tracer=cp_tracer,
    )
    await wakes.start(nc)

    r = await routers(
        nats_urls=[nats_server.url],
        prefix=prefix,
        auth=False,
        router_id="rtrace",
        otlp_traces_endpoint=phoenix.traces_endpoint,
    )
    await asyncio.wait_for(r.synced.wait(), 10)
    assert r.ctx.tracing is not None
    r.ctx.holding.stream_after_s = 30.0  # no SSE comments: the stream's bytes are the engines'
    (victim_proc, victim), (_, good) = engine_procs

    trace_id, client_span = random.getrandbits(128) | 1, random.getrandbits(64) | 1
    headers = {"traceparent": f"00-{trace_id:032x}-{client_span:016x}-01"}
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "tell me about tracing"}],
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def call() -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(
                f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body, headers=headers
            ) as resp:
                return resp.status, await resp.read()

    caplog.set_level(logging.INFO, logger="llmgw.controlplane.wakes")
    task = asyncio.create_task(call())
    try:
        await eventually(lambda: bool(asked), timeout=10.0, what="the router to ask for a wake")
        # The wake brings one replica: the held request goes to it.
        await routing.endpoints((victim,))

        def on_victim() -> int:
            return sum(e.in_flight for e in r.ctx.pool.by_key.values() if e.url == victim)

        await eventually(
            lambda: on_victim() == 1, timeout=10.0, what="the stream to start on the first replica"
        )
        await asyncio.sleep(0.5)  # tokens flow
        # A second replica, then the first one's engine dies mid-stream.
        await routing.endpoints((victim, good))
        await eventually(lambda: len(r.ctx.pool.by_key) == 2, timeout=10.0, what="the second replica")
        os.killpg(victim_proc.pid, signal.SIGKILL)
        status, raw = await asyncio.wait_for(task, 60)
    finally:
        if not task.done():
            task.cancel()
    assert status == 200
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
    assert r.ctx.metrics.migrations_count("m1", "ok") == 1

    # The control plane logged the wake with the trace's id.
    assert f"trace {trace_id:032x}" in caplog.text

    # Every span out to Phoenix, then read back.
    await asyncio.to_thread(r.ctx.tracing.tracer.provider.force_flush)
    await wakes.stop()
    await asyncio.to_thread(cp_tracer.shutdown)

    async def complete() -> list[dict[str, Any]] | None:
        spans = await asyncio.to_thread(phoenix.spans, trace_id)
        chats = sum(s["name"] == "chat m1" for s in spans)
        cp = any(s["name"] == "wake m1" and s["attributes"].get("llmgw.router") == "rtrace" for s in spans)
        server = any(s["name"] == "POST /v1/chat/completions" for s in spans)
        wakes = sum(s["name"] == "wake m1" for s in spans)
        return spans if chats >= 2 and cp and server and wakes >= 2 else None

    spans = await eventually(complete, timeout=30.0, every=0.5, what="the trace's spans in Phoenix")
    by_id = {s["context"]["span_id"]: s for s in spans}
    (server,) = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    # Under the client's span, in the client's trace.
    assert server["parent_id"] == f"{client_span:016x}"
    a = server["attributes"]
    assert a["gen_ai.request.model"] == "m1" and a["gen_ai.response.model"] == "m1"
    assert a["http.response.status_code"] == 200

    names = [n for n, _ in _events(server)]
    want = [
        "llmgw.held",
        "llmgw.wake.asked",
        "llmgw.wake.answered",
        "llmgw.wake.served",
        "llmgw.hold.ended",
        "llmgw.stream.broken",
        "llmgw.migration",
    ]
    assert [n for n in names if n in want] == want, names
    ev = dict(_events(server))
    assert ev["llmgw.held"]["llmgw.reason"] == "cold"
    assert ev["llmgw.wake.answered"]["llmgw.wake.state"] == "waking"
    assert ev["llmgw.migration"]["llmgw.replica"] == "r1"
    assert ev["llmgw.migration"]["llmgw.offset_tokens"] > 0

    # The attempts: the first broke on r0, the continuation finished on r1; both under the request.
    chats = sorted((s for s in spans if s["name"] == "chat m1"), key=lambda s: s["start_time"])
    first, cont = chats[0], chats[-1]
    assert first["parent_id"] == server["context"]["span_id"] == cont["parent_id"]
    assert first["attributes"]["llmgw.replica"] == "r0"
    assert first["attributes"]["error.type"] == "stream_broken"
    assert cont["attributes"]["llmgw.replica"] == "r1" and cont["attributes"]["llmgw.continuation"] is True
    assert "error.type" not in cont["attributes"]

    # The wake: the router's CLIENT span under the request, the control plane's span under it.
    (cp_span,) = [s for s in spans if s["name"] == "wake m1" and "llmgw.router" in s["attributes"]]
    router_wake = by_id[cp_span["parent_id"]]
    assert router_wake["name"] == "wake m1" and router_wake["parent_id"] == server["context"]["span_id"]
    assert router_wake["attributes"]["llmgw.wake.state"] == "waking"
    assert cp_span["attributes"]["llmgw.wake.state"] == "waking"
    # Every span of the trace fits in the request's time.
    assert all(s["start_time"] >= server["start_time"] for s in spans)
