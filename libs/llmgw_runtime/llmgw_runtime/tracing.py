"""OpenTelemetry export, for the processes that trace (the router, the control plane): built only when
an OTLP endpoint is configured.

The SDK and the OTLP exporter (protobuf, requests) are the ``tracing`` extra and are imported here,
inside :func:`start_tracing`: a process with tracing off never imports them. Spans go out in batches
from the SDK's own thread (``BatchSpanProcessor``) over OTLP/HTTP (protobuf) to the endpoint as given,
e.g. ``http://collector:4318/v1/traces``; a receiver that is down costs dropped spans, never a wait on
the request path. Sampling: the caller's decision when it sent one (a sampled ``traceparent`` is
traced, an unsampled one is not), else ``ratio`` of new traces (``ParentBased(TraceIdRatioBased)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from llmgw_common.errors import InvalidInput
from llmgw_common.traceparent import TraceParent, clean_tracestate

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanKind
    from opentelemetry.trace import Tracer as OtelTracer
    from opentelemetry.util.types import AttributeValue

EXTRA_HINT = "install the tracing extra: pip install 'llmgw[tracing]'"


class TracingUnavailable(InvalidInput):
    """An OTLP endpoint is configured but the OpenTelemetry SDK is not installed: the command says so
    (``error: ...``, exit status 2), no traceback."""


class Tracer:
    """One process's tracer and the provider that exports its spans."""

    def __init__(self, provider: TracerProvider, tracer: OtelTracer) -> None:
        self.provider, self.tracer = provider, tracer

    def start(
        self,
        name: str,
        kind: SpanKind,
        parent: TraceParent | Span | None = None,
        tracestate: str | None = None,
        start_ns: int | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> Span:
        """A span under ``parent`` (a remote one read from a header, one of ours, or none: a new trace)."""
        from opentelemetry import trace

        ctx: Context | None = None
        if isinstance(parent, tuple):
            state = trace.TraceState.from_header([tracestate]) if tracestate else None
            remote = trace.SpanContext(
                parent.trace_id,
                parent.span_id,
                is_remote=True,
                trace_flags=trace.TraceFlags(parent.flags & 0xFF),
                trace_state=state,
            )
            ctx = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        elif parent is not None:
            ctx = trace.set_span_in_context(parent)
        else:
            # Explicitly empty: never the thread's current span (nothing here sets one).
            from opentelemetry.context import Context

            ctx = Context()
        # Attributes given at the start: one pass of the SDK's checks, not one per set_attributes.
        return self.tracer.start_span(
            name, context=ctx, kind=kind, attributes=attributes, start_time=start_ns
        )

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter's thread (bounded by the SDK's own timeout)."""
        self.provider.shutdown()


def traceparent_of(span: Span) -> TraceParent:
    """``span``'s context, to be sent as the parent of what it calls."""
    c = span.get_span_context()
    return TraceParent(c.trace_id, c.span_id, int(c.trace_flags))


def tracestate_of(span: Span) -> str | None:
    header = span.get_span_context().trace_state.to_header()
    return clean_tracestate(header) if header else None


def start_tracing(
    service: str,
    instance: str,
    endpoint: str,
    ratio: float,
    *,
    exporter_timeout_s: float = 5.0,
) -> Tracer:
    """A tracer exporting to ``endpoint`` (OTLP/HTTP), sampling ``ratio`` of new traces."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as e:
        raise TracingUnavailable(f"otlp_traces_endpoint is set but {e.name} is missing: {EXTRA_HINT}") from e
    resource = Resource.create({"service.name": service, "service.instance.id": instance})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(ratio)))
    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=exporter_timeout_s)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracer(provider, provider.get_tracer("llmgw"))
