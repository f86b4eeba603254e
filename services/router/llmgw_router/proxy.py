"""Send one admitted request to an endpoint and pass the answer back byte for byte.

A failure before the first byte reaches the client (connect error or refusal, the engine closing
the connection, a 502/503 from the engine, a stream that dies before its first chunk) is retried on
another endpoint, up to ``retries`` times. A stream that breaks after its first byte is continued on
another endpoint (:mod:`llmgw_router.failover.migration`). In-flight counts are released in ``finally`` on every
path, cancellation included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from llmgw_router.context import RouterContext
from llmgw_router.dialects.stored import StreamTagger, tag_ids
from llmgw_router.errors import CLIENT_GONE, Answer, RouterError, error_response
from llmgw_router.failover.migration import Migration
from llmgw_router.http.request import Request
from llmgw_router.http.response import RelayedResponse, StreamResponse, relay_lines
from llmgw_router.routing.endpoints import EndpointState
from llmgw_router.routing.pick import pick
from llmgw_router.tenancy.usage import TAIL_BYTES, find_usage
from llmgw_router.upstream.client import UpstreamResponse
from llmgw_router.upstream.connection import ConnectFailed, ReadTimeout, UpstreamError

log = logging.getLogger("llmgw.router.proxy")

RETRY_STATUSES = frozenset({502, 503})
_DROP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "Content-Length",
        "Date",
        "Server",
        "Proxy-Connection",
        "Upgrade",
        "TE",
        "Trailer",
    )
)
_DROP_RAW = frozenset(h.encode() for h in _DROP)
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class Outbound:
    """One admitted request as it goes to an engine, and what its answer is counted under."""

    path: str
    body: bytes
    model: str
    key_id: str
    want_usage: bool
    # The parsed JSON body (None for a form or a bodiless request): migration reads it.
    req: dict[str, Any] | None = None
    # A held stream's answer already begun (holding.py): a streamed answer continues it.
    started: StreamResponse | None = None
    # The request's prefix key (affinity.py), when prefix-aware routing is on.
    affinity: int | None = None
    # The one endpoint that may answer (it stores the response the request names: stored.py).
    pin: EndpointState | None = None
    # The answer carries ids of stored responses: tag them with the endpoint's replica (stored.py).
    stores: bool = False
    method: bytes = b"POST"
    content_type: bytes = b"application/json"
    # Header lines the router adds to the engine's (a limited key's x-ratelimit-*: quota.Ticket).
    extra_lines: bytes = b""
    # A limited key's: a stream's events are counted against its tokens per minute as they pass.
    metered: bool = False
    # Set by forward(): every attempt found no engine listening (nothing was sent), so the table
    # that named them is likely stale; the handler waits for the next one and goes again.
    refused_everywhere: bool = False


class _Retryable(Exception):
    """The attempt failed before anything reached the client; another endpoint may be tried."""

    def __init__(self, message: str, status: int | None = None, refused: bool = False) -> None:
        super().__init__(message)
        self.status = status
        # No engine listening: the connection was refused (or timed out) before a byte was sent.
        self.refused = refused


async def forward(ctx: RouterContext, request: Request, out: Outbound) -> tuple[Answer, int]:
    """Proxy the request; return the response and the status to record."""
    t0 = time.perf_counter()
    model = out.model
    mig = Migration.of(ctx, out.path, out.req, ctx.pool.profiles.get(model))
    tried: list[EndpointState] = mig.tried if mig is not None else []
    problem = ""
    # Engine statuses of failed attempts (None: no answer at all).
    statuses: list[int | None] = []
    refused = 0
    for attempt in range(ctx.limits.retries + 1):
        now = ctx.clock()
        ep = pick(ctx.pool, ctx.choosing, model, tried, now, out.affinity, out.pin)
        if ep is None:
            break
        if attempt:
            ctx.metrics.retry(model)
        tried.append(ep)
        ctx.idle.stamp(ep.replica_id, now)
        ep.in_flight += 1
        ctx.in_flight += 1
        verdict: bool | None = None  # breaker outcome: True success, False failure, None unknown
        try:
            resp, status, verdict = await _attempt(ctx, request, ep, out, t0, mig)
            return resp, status
        except _Retryable as e:
            verdict = False
            problem = str(e)
            statuses.append(e.status)
            refused += e.refused
            log.debug("attempt %d on %s failed before the first byte: %s", attempt + 1, ep.url, problem)
        finally:
            ep.in_flight -= 1
            ctx.in_flight -= 1
            if verdict is True:
                ep.breaker.success()
            elif verdict is False:
                ep.breaker.failure(ctx.clock())
            else:
                ep.breaker.abandon()
    if not tried:
        if out.pin is not None:
            why = f"replica {out.pin.replica_id}, which stores the response asked for, is failing (circuit open)"
            return error_response(503, why, retry_after=1), 503
        return error_response(503, ctx.pool.why_unavailable(model, ctx.clock()), retry_after=1), 503
    n = len(tried)
    out.refused_everywhere = refused == n
    msg = f"model {model!r}: {n} attempt{'s' if n > 1 else ''} failed before an answer: {problem}"
    if statuses and all(s == 503 for s in statuses):
        # Every replica said it cannot serve now (loading, overloaded): unavailable, not broken.
        return error_response(503, msg, retry_after=1), 503
    return error_response(502, msg), 502


async def _attempt(
    ctx: RouterContext,
    request: Request,
    ep: EndpointState,
    out: Outbound,
    t0: float,
    mig: Migration | None,
) -> tuple[Answer, int, bool | None]:
    assert ctx.upstream is not None
    model = out.model
    try:
        up = await ctx.upstream.post(
            ep.url, out.path, out.body, out.content_type, held=ep.answers, method=out.method
        )
    except ReadTimeout:
        return _gateway_timeout(ep), 504, False
    except UpstreamError as e:  # ConnectFailed, Disconnected: nothing came back
        raise _Retryable(f"{ep.replica_id}: {e}", refused=isinstance(e, ConnectFailed)) from None
    # Withdrawing the endpoint aborts the answer (migration.abort_withdrawn): retried or continued elsewhere.
    ep.answers.add(up)
    try:
        status = up.status
        if status in RETRY_STATUSES and out.pin is None:
            try:
                detail = (await up.readany())[:300].decode("utf-8", "replace")
            except UpstreamError:
                detail = ""
            raise _Retryable(f"{ep.replica_id} answered {status}: {detail}", status)
        verdict = status < 500
        # The header lines to relay, and the answer's Content-Type and Content-Length, in one pass.
        lines, ctype, clen = relay_lines(up.headers, _DROP_RAW)
        if out.extra_lines:
            lines += out.extra_lines
        length = int(clen) if clen is not None and clen.isdigit() else None
        if length is not None and not (ctype or b"").startswith(b"text/event-stream"):
            try:
                data = await up.read()
            except ReadTimeout:
                return _gateway_timeout(ep), 504, False
            except UpstreamError as e:
                raise _Retryable(f"{ep.replica_id}: answer cut short: {e}") from None
            elapsed = time.perf_counter() - t0
            ep.observe_latency(elapsed)
            ctx.metrics.first_byte(model, elapsed)
            if status < 300:
                ctx.usage.add(out.key_id, model, find_usage(data))
                # In the durable ledger before the client has the answer (ledger.py: group commit).
                await ctx.usage.settled()
                if out.stores:
                    data = tag_ids(data, ep.tag)
            return RelayedResponse(status, data, lines, ctype is not None), status, verdict
        return await _stream(ctx, request, up, ep, out, t0, verdict, mig, lines)
    finally:
        ep.answers.discard(up)
        up.close()  # no-op after a full read; drops the connection after a partial one


async def _stream(
    ctx: RouterContext,
    request: Request,
    up: UpstreamResponse,
    ep: EndpointState,
    out: Outbound,
    t0: float,
    verdict: bool,
    mig: Migration | None,
    lines: bytes = b"",
) -> tuple[Answer, int, bool | None]:
    """``lines``: the engine's header lines to relay (relay_lines)."""
    status = up.status
    model, key_id, want_usage, started = out.model, out.key_id, out.want_usage, out.started
    try:
        first = await up.readany()
    except ReadTimeout:
        return _gateway_timeout(ep), 504, False
    except UpstreamError as e:
        raise _Retryable(f"{ep.replica_id}: stream ended before its first byte: {e}") from None
    ctx.metrics.first_byte(model, time.perf_counter() - t0)
    if verdict:
        # The engine answers: say so now, not when the stream ends. A half-open breaker lets one probe
        # through at a time, so a long stream as the probe would keep the endpoint shut for its length.
        ep.breaker.success()
    if started is None:
        resp = StreamResponse(status=status)
        resp.raw_headers = lines
    else:
        resp = started
    tagger = StreamTagger(ep.tag) if out.stores and status < 300 else None
    tail = b""
    # Events streamed, each taken as one completion token meanwhile: a long stream weighs on its
    # key's tokens per minute while it runs; the answer's usage settles the count (usage.add).
    metered = out.metered and status < 300
    streamed = 0
    # Events relayed so far (any key): what a stream whose client left is billed as completion tokens.
    relayed = 0
    added = False

    def client_left() -> tuple[StreamResponse, int, bool | None]:
        # The engine produced (and was asked for) what it relayed: that is billed, the request too,
        # though the client has not the whole answer. No wait for the ledger: nobody is waiting.
        nonlocal added
        if status < 300 and not added:
            added = True
            found = find_usage(tail) if want_usage else None
            ctx.usage.add(key_id, model, found if found is not None else (0, relayed), streamed)
        return resp, CLIENT_GONE, None

    try:
        try:
            if started is None:
                await resp.prepare(request)
        except ConnectionResetError:
            return client_left()
        chunk: bytes = first
        while True:
            sent = chunk if mig is None or status != 200 else mig.relay_bytes(chunk)
            if want_usage:
                tail = (tail + sent)[-TAIL_BYTES:] if len(sent) < TAIL_BYTES else sent[-TAIL_BYTES:]
            events = sent.count(b"data: {")
            relayed += events
            if metered and events:
                streamed += events
                ctx.quota.add_tokens(key_id, model, events, ctx.clock())
            try:
                if not chunk or up.at_eof():
                    if mig is not None and status == 200 and not mig.complete():
                        raise UpstreamError("the stream ended without [DONE]")
                    if tagger is not None:
                        sent = tagger.feed(sent) + tagger.flush()
                    if status < 300:
                        # Counted, and in the durable ledger, before the client has the stream's end.
                        ctx.usage.add(key_id, model, find_usage(tail) if want_usage else None, streamed)
                        added = True
                        await ctx.usage.settled()
                    # Nothing more will come: the last bytes and the end of the stream in one write.
                    await resp.write_eof(sent)
                    break
                if tagger is not None:
                    sent = tagger.feed(sent)
                if sent:
                    await resp.write(sent)
            except ConnectionResetError:
                # The client went away mid-stream; closing the upstream tells the engine to stop.
                return client_left()
            chunk = await up.readany()
    except asyncio.CancelledError:
        # Mostly the client hanging up (its handler is cancelled, see http_connection.py).
        client_left()
        raise
    except UpstreamError as e:
        # The engine failed after the first byte: continue the stream elsewhere, or end the client's.
        up.close()
        if mig is None or status != 200:
            log.warning("stream from %s broke after the first byte: %s", ep.replica_id, e)
            return resp, 502, False
        # Say so now, not when the continuation ends: others should not be sent to it meanwhile.
        ep.breaker.failure(ctx.clock())
        status = await mig.resume(ctx, resp, f"{ep.replica_id}: {e}")
        if status == 200:
            used = mig.relay.sent.usage
            ctx.usage.add(key_id, model, used if want_usage else None, streamed)
        return resp, status, None
    ep.observe_latency(time.perf_counter() - t0)
    return resp, status, verdict


def _gateway_timeout(ep: EndpointState) -> RouterError:
    return error_response(504, f"{ep.replica_id} did not answer in time")


def parse_request(body: bytes) -> dict[str, Any] | str:
    """The request as a dict, or what is wrong with it (a 400 message)."""
    try:
        if body[:1] == b"{" and body[1:2] != b"\0":
            # What json.loads does with these bytes (json.detect_encoding says UTF-8 for them), minus
            # its checks and the detection: the same object, or the same error.
            obj = _DECODER.decode(body.decode("utf-8", "surrogatepass"))
        else:
            obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        return f"the request body is not valid JSON: {e}"
    except RecursionError:
        # json.loads recurses per nesting level: `[[[[...` 100,000 deep must be a 400, not a 500.
        return "the request body is not valid JSON: nested too deeply"
    if not isinstance(obj, dict):
        return "the request body must be a JSON object"
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        return "you must provide a model parameter"
    return obj
