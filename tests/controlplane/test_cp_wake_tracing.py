"""A wake asked by a traced request (issue 34): its trace context comes in the NATS headers; the control
plane logs its answer with the trace id and, exporting spans, records one under the router's. Real
nats-server; the spans in the OpenTelemetry SDK's own in-memory exporter."""

from __future__ import annotations

import logging
import time

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import decode, encode
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_common.subjects import Subjects
from llmgw_controlplane.wakes import WakeResponder
from llmgw_runtime import bus
from llmgw_runtime.tracing import Tracer

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def _answer(req: WakeRequest) -> WakeReply:
    return WakeReply(model=req.model, state=WakeState.WAKING)


async def _ask(nc: NATS, prefix: str, headers: dict[str, str] | None) -> WakeReply:
    req = WakeRequest(model="m1", router="r1", sent_at=time.time())
    msg = await nc.request(Subjects(prefix).wake("r1"), encode(req), timeout=10, headers=headers)
    return decode(msg.data, WakeReply)


@pytest.mark.parametrize("exporting", [True, False])
async def test_a_traced_wake_is_logged_with_its_trace_and_spanned(
    nc: NATS, prefix: str, caplog: pytest.LogCaptureFixture, exporting: bool
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    responder = WakeResponder(
        Subjects(prefix).all_wake(),
        _answer,
        bus.DropLog(logging.getLogger("t")),
        version=lambda: 0,
        tracer=Tracer(provider, provider.get_tracer("t")) if exporting else None,
    )
    await responder.start(nc)
    caplog.set_level(logging.INFO, logger="llmgw.controlplane.wakes")
    try:
        reply = await _ask(nc, prefix, {"traceparent": f"00-{TRACE}-{SPAN}-01"})
        assert reply.state is WakeState.WAKING
        assert f"trace {TRACE}" in caplog.text
        spans = exporter.get_finished_spans()
        if not exporting:
            assert spans == ()
            return
        (span,) = spans
        assert span.kind is SpanKind.SERVER and span.name == "wake m1"
        assert span.context is not None and f"{span.context.trace_id:032x}" == TRACE
        assert span.parent is not None and f"{span.parent.span_id:016x}" == SPAN
        assert (span.attributes or {})["llmgw.wake.state"] == "waking"
        assert (span.attributes or {})["llmgw.router"] == "r1"
    finally:
        await responder.stop()


@pytest.mark.parametrize("headers", [None, {"traceparent": "garbage"}, {"other": "x"}])
async def test_an_untraced_wake_is_answered_as_ever_and_neither_logged_nor_spanned(
    nc: NATS, prefix: str, caplog: pytest.LogCaptureFixture, headers: dict[str, str] | None
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    responder = WakeResponder(
        Subjects(prefix).all_wake(),
        _answer,
        bus.DropLog(logging.getLogger("t")),
        version=lambda: 0,
        tracer=Tracer(provider, provider.get_tracer("t")),
    )
    await responder.start(nc)
    caplog.set_level(logging.INFO, logger="llmgw.controlplane.wakes")
    try:
        assert (await _ask(nc, prefix, headers)).state is WakeState.WAKING
        assert responder.answered == 1
        assert "trace " not in caplog.text
        assert exporter.get_finished_spans() == ()
    finally:
        await responder.stop()
