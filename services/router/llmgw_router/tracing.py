"""A request's trace: one SERVER span for the request, one CLIENT span per engine asked, events for
what the router did meanwhile (docs/tracing.md).

Off (no ``otlp_traces_endpoint``, the default) nothing here runs but :func:`forwarded`: a client's
``traceparent`` that parses goes on to the engine, made anew (a malformed one is dropped), and a request
without one costs the one header lookup. The OpenTelemetry SDK is imported only when tracing is on
(``llmgw_runtime.tracing``); spans are the SDK's, exported from its own thread.

On, :meth:`RouterTracing.begin` opens the SERVER span under the client's ``traceparent`` (or a new
trace), every attempt opens a CLIENT span whose context is the engine's ``traceparent``, and the
request path adds events (held, admission and fair-queue waits, wakes, retries, migrations, refusals).
Attributes follow the OpenTelemetry GenAI conventions (``gen_ai.*``), with ``server.address`` and
``error.type`` from the HTTP ones.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from llmgw_common.apis import Api
from llmgw_common.traceparent import (
    TraceParent,
    canonical_traceparent,
    clean_tracestate,
    format_traceparent,
    header_lines,
    parse_traceparent,
)
from llmgw_router.http.request import Request
from llmgw_router.routing.endpoints import EndpointState
from llmgw_runtime.tracing import Tracer, traceparent_of, tracestate_of

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from opentelemetry.util.types import AttributeValue

# gen_ai.operation.name: the conventions' names where one fits, else the API family's own.
OPERATION: dict[Api, str] = {
    Api.CHAT: "chat",
    Api.RESPONSES: "chat",
    Api.MESSAGES: "chat",
    Api.COMPLETIONS: "text_completion",
    Api.EMBEDDINGS: "embeddings",
}

# The model an engine says answered: the first "model" field of its answer (a stream's first event).
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
_SNIFF_BYTES = 4096

Attrs = dict[str, "AttributeValue"]


def forwarded(request: Request) -> bytes:
    """Tracing off: the client's trace context as header lines for the engine, b"" when it sent none
    that parses (a malformed ``traceparent`` is never passed on as it came)."""
    value = request.traceparent
    if value is None:
        return b""
    parent = canonical_traceparent(value)
    if parent is None:
        return b""
    return header_lines(parent, clean_tracestate(request.header(b"tracestate")))


@functools.lru_cache(maxsize=1024)
def _address(url: str) -> tuple[str, int]:
    """An endpoint's host and port (server.address, server.port), read once per endpoint."""
    u = urlsplit(url)
    return u.hostname or "", u.port or (443 if u.scheme == "https" else 80)


def response_model(data: bytes) -> str | None:
    m = _MODEL.search(data, 0, _SNIFF_BYTES)
    return m.group(1).decode("utf-8", "replace") if m is not None else None


class RouterTracing:
    """The router's tracer; ``ctx.tracing`` is None when tracing is off.

    The sampling decision is taken here, before the SDK is asked for anything: a request that is not
    recorded costs no span object at all (the SDK's non-recording spans cost two thirds of a recorded
    one's CPU here), only the context its engine is sent. So the SDK's own sampler records every span it
    is asked for (its default, ``ParentBased(ALWAYS_ON)``)."""

    def __init__(self, tracer: Tracer, ratio: float = 1.0, rng: random.Random | None = None) -> None:
        self.tracer, self.ratio = tracer, ratio
        self.rng = rng or random.Random()

    def begin(
        self, request: Request, method: str, path: str, api: Api, start_ns: int
    ) -> RequestTrace | bytes:
        """The SERVER span of one request, under the client's context when it sent one that parses; or,
        for a request not sampled, the header lines its engine is sent instead: the client's context
        as it came (made anew), else a new trace's, marked not sampled."""
        from opentelemetry.trace import SpanKind

        sent = request.traceparent
        parent = parse_traceparent(sent)
        # The caller's decision when it sent one; else ``ratio`` of new traces.
        if not (parent.sampled if parent is not None else self.rng.random() < self.ratio):
            if parent is not None:
                return header_lines(parent, clean_tracestate(request.header(b"tracestate")))
            return header_lines(
                TraceParent(self.rng.getrandbits(128) or 1, self.rng.getrandbits(64) or 1, 0), None
            )
        state = clean_tracestate(request.header(b"tracestate")) if parent is not None else None
        op = OPERATION.get(api, api.value)
        attrs: dict[str, AttributeValue] = {
            "http.request.method": method,
            "url.path": path,
            "gen_ai.operation.name": op,
            # A header that did not parse started this trace: said, as the operator will ask why.
            "llmgw.traceparent.rejected": parent is None and sent is not None,
        }
        span = self.tracer.start(f"{method} {path}", SpanKind.SERVER, parent, state, start_ns, attrs)
        return RequestTrace(self.tracer, span, op)

    def shutdown(self) -> None:
        self.tracer.shutdown()


class RequestTrace:
    """One request's SERVER span, and what its attempts learnt (the model that answered, the usage)."""

    __slots__ = ("attempts", "op", "response_model", "span", "status", "tracer", "usage")

    def __init__(self, tracer: Tracer, span: Span, op: str) -> None:
        self.tracer, self.span, self.op = tracer, span, op
        self.attempts = 0
        self.response_model: str | None = None
        self.usage: tuple[int, int] | None = None
        # The status the router counted for the request, once it did (499: the client left mid-answer).
        self.status: int | None = None

    def event(
        self, name: str, attrs: Mapping[str, AttributeValue] | None = None, at: float | None = None
    ) -> None:
        """An event on the request's span; ``at``: when it happened (``time.time()``), if not now."""
        self.span.add_event(name, attrs, None if at is None else int(at * 1e9))

    def admitted(self, model: str, key_id: str, stream: bool) -> None:
        self.span.set_attributes(
            {"gen_ai.request.model": model, "llmgw.key_id": key_id, "llmgw.stream": stream}
        )

    def attempt(self, ep: EndpointState, model: str, continuation: bool = False) -> AttemptSpan:
        """A CLIENT span for asking ``ep``: its context is what the engine is sent as ``traceparent``."""
        from opentelemetry.trace import SpanKind

        self.attempts += 1
        host, port = _address(ep.url)
        attrs: dict[str, AttributeValue] = {
            "gen_ai.operation.name": self.op,
            "gen_ai.request.model": model,
            "server.address": host,
            "server.port": port,
            "llmgw.replica": ep.replica_id,
            "llmgw.attempt": self.attempts,
            "llmgw.continuation": continuation,
        }
        span = self.tracer.start(f"{self.op} {model}", SpanKind.CLIENT, self.span, attributes=attrs)
        return AttemptSpan(self, span, header_lines(traceparent_of(span), tracestate_of(span)))

    def wake(self, model: str) -> WakeSpan:
        """A CLIENT span for one wake request to the control plane, its context for the NATS headers."""
        from opentelemetry.trace import SpanKind

        span = self.tracer.start(f"wake {model}", SpanKind.CLIENT, self.span)
        if span.is_recording():
            span.set_attributes({"messaging.system": "nats", "llmgw.model": model})
        return WakeSpan(span, {"traceparent": format_traceparent(*traceparent_of(span))})

    def finish(self, status: int | None, error: str | None = None) -> None:
        """End the SERVER span: the status given the client (None: the client went away first)."""
        span = self.span
        if span.is_recording():
            attrs: Attrs = {}
            if status is not None:
                attrs["http.response.status_code"] = status
            if self.response_model is not None:
                attrs["gen_ai.response.model"] = self.response_model
            if self.usage is not None:
                attrs["gen_ai.usage.input_tokens"] = self.usage[0]
                attrs["gen_ai.usage.output_tokens"] = self.usage[1]
            err = error or (str(status) if status is not None and status >= 500 else None)
            if status is None:
                err = "client_gone"
            if err is not None:
                attrs["error.type"] = err
                _set_error(span, err)
            span.set_attributes(attrs)
        span.end()


class AttemptSpan:
    """One engine asked: its CLIENT span and the header lines that carry it to the engine. What the
    answer says is kept and set on the span once, at its end (each of the SDK's set calls takes a lock
    and checks every value)."""

    __slots__ = ("headers", "model", "span", "trace", "usage")

    def __init__(self, trace: RequestTrace, span: Span, headers: bytes) -> None:
        self.trace, self.span, self.headers = trace, span, headers
        self.model: str | None = None
        self.usage: tuple[int, int] | None = None

    def answered(self, data: bytes) -> None:
        """The engine's first bytes (a whole answer, a stream's first events): the model it names."""
        model = response_model(data)
        if model is not None:
            self.model = self.trace.response_model = model

    def used(self, usage: tuple[int, int] | None) -> None:
        if usage is not None:
            self.usage = self.trace.usage = usage

    def end(self, status: int | None, error: str | None = None) -> None:
        span = self.span
        attrs: dict[str, AttributeValue] = {}
        if status is not None:
            attrs["http.response.status_code"] = status
        if self.model is not None:
            attrs["gen_ai.response.model"] = self.model
        if self.usage is not None:
            attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"] = self.usage
        err = error or (str(status) if status is not None and status >= 400 else None)
        if err is not None:
            attrs["error.type"] = err
            _set_error(span, err)
        span.set_attributes(attrs)
        span.end()


class WakeSpan:
    """One wake request: its CLIENT span and the NATS headers that carry it."""

    __slots__ = ("headers", "span")

    def __init__(self, span: Span, headers: dict[str, str]) -> None:
        self.span, self.headers = span, headers

    def end(self, state: str | None) -> None:
        """``state``: the control plane's answer (None: none came)."""
        span = self.span
        if span.is_recording():
            if state is None:
                span.set_attribute("error.type", "no_answer")
                _set_error(span, "no answer")
            else:
                span.set_attribute("llmgw.wake.state", state)
        span.end()


def _set_error(span: Span, what: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, what))
