"""A proxied request, top to bottom: admitted, held, let through its model's gate, answered.

    handle ─> admit()    the key, the body within its limits, the dialect's parse, the catalog and what
          │              the model serves, a stored response's replica, the key's quota:
          │              one immutable :class:`Admitted`, or the refusal
          └─> serve()    held while no replica is ready (holding.py), the model's gate (admission.py),
                └─> answer()  THE loop: an endpoint picked for each go (routing/pick.py), one list of
                      │       those tried: a first answer retried elsewhere while nothing reached the
                      │       client, the stale table waited out when every replica refused the
                      │       connection, a stream broken after its first byte continued elsewhere
                      ├─> attempt()   one endpoint asked; its answer relayed whole or as a stream
                      └─> continue_on() (failover/) the rest of a broken stream from another endpoint

Each step returns a value (an answer and the status to record, or why it failed); the status is
recorded once, by :func:`serve`. What differs by API family is the route's dialect (dialects/); this
module never asks which API it serves. Nothing here touches NATS or waits for it (the usage ledger is
written behind the answers: tenancy/ledger.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, NamedTuple

from llmgw_common.catalog import ModelProfile
from llmgw_common.kvcache import request_salt
from llmgw_common.messages import ApiKeyRecord
from llmgw_router.cache.router import Prefix
from llmgw_router.context import RouterContext
from llmgw_router.dialects.dialect import Dialect
from llmgw_router.dialects.routes import Route
from llmgw_router.errors import CLIENT_GONE, Answer, RouterError, error_response
from llmgw_router.failover.continuation import Close, Continue, Refuse
from llmgw_router.failover.migration import Migration, close_with, continue_on
from llmgw_router.http.request import HTTPRequestEntityTooLarge, Request
from llmgw_router.http.response import RelayedResponse, StreamResponse, relay_lines
from llmgw_router.refusals import not_found_message
from llmgw_router.routing.affinity import prompt_key
from llmgw_router.routing.endpoints import EndpointState
from llmgw_router.routing.pick import pick
from llmgw_router.tenancy.admission import AdmissionRefused, Gate
from llmgw_router.tenancy.keycheck import ANONYMOUS, Handler
from llmgw_router.tenancy.keys import allows_model
from llmgw_router.tenancy.quota import Ticket
from llmgw_router.tenancy.salt import salt_for
from llmgw_router.tenancy.usage import TAIL_BYTES, find_usage
from llmgw_router.tracing import AttemptSpan, RequestTrace, forwarded
from llmgw_router.upstream.client import UpstreamResponse
from llmgw_router.upstream.connection import ConnectFailed, ReadTimeout, UpstreamError

log = logging.getLogger("llmgw.router.proxy")

# Metrics label for model names that are not in the catalog (client-chosen: unbounded otherwise).
UNKNOWN_MODEL = "-"
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


class Admitted(NamedTuple):
    """One request as admission made it: what every later step reads, and none writes."""

    dialect: Dialect
    record: ApiKeyRecord | None
    key_id: str
    model: str
    # The catalog's entry (None for a stored response's GET or cancel: routed by its id alone).
    profile: ModelProfile | None
    method: bytes
    # The engine's path.
    path: str
    body: bytes
    content_type: bytes
    # The parsed JSON body (None for a form or a bodiless request): the continuation reads it.
    json: dict[str, Any] | None
    stream: bool
    # The stream ends with its usage (else it is counted by its events).
    want_usage: bool
    # The request's prefix key (affinity.py), when prefix-aware routing is on.
    affinity: int | None
    # Its prompt as the blocks its engines cache (cache/), when its model routes by cached prefix.
    prefix: Prefix | None
    # The one endpoint that may answer (it stores the response the request names: dialects/stored.py).
    pin: EndpointState | None
    # A limited key's hold on its meters (quota.py): its x-ratelimit-* lines, its streamed tokens.
    ticket: Ticket | None
    t0: float
    # A LoRA adapter asked for by its name (``model``), served by its base's endpoints that hold it.
    adapter: str | None = None
    # The model whose endpoints answer: an adapter's base, else ``model`` itself.
    base: str = ""
    # Its spans (tracing on: tracing.py), or None.
    trace: RequestTrace | None = None
    # Tracing off: the client's trace context as header lines for the engine (b"": none that parses).
    forward: bytes = b""


class _Failed(NamedTuple):
    """An attempt that failed before anything reached the client: another endpoint may be tried."""

    why: str
    # The engine's status (None: no answer at all).
    status: int | None = None
    # No engine listening: the connection was refused (or timed out) before a byte was sent.
    refused: bool = False
    # The engine does not have the adapter asked for (404: unloaded since its report, or restarted).
    missing: bool = False


class _Broken(NamedTuple):
    """A stream that broke after its first byte, its client's response begun: to be continued."""

    resp: StreamResponse
    why: str
    # Events metered against the key as they passed (made good by the usage at the end).
    streamed: int


# ------------------------------------------------------------ the handler


def make_proxy_handler(ctx: RouterContext, route: Route) -> Handler:
    """The handler of every proxied route (``routes.py``)."""
    dialect = route.dialect
    keycheck = ctx.keycheck
    tracing = ctx.tracing

    async def handle(request: Request) -> Answer:
        t0 = time.perf_counter()
        # One SERVER span per sampled request when tracing is on (a request not sampled: only the context
        # its engine is sent); off, nothing but the client's context passed on.
        tr: RequestTrace | None = None
        fwd: bytes | None = None
        if tracing is not None:
            began = tracing.begin(request, "POST", route.path, route.api, time.time_ns())
            if isinstance(began, bytes):
                fwd = began
            else:
                tr = began
        # The record kept here, not on the request: nothing else reads it from a proxied request.
        rec = keycheck.record(request)
        if isinstance(rec, RouterError):
            if tr is not None:
                _traced_end(tr, rec)
            return dialect.refusal(rec)
        body = whole_body(ctx, request)
        if body is None:
            body = await read_body(ctx, request)
        admitted = (
            body if isinstance(body, RouterError) else admit(ctx, route, request, rec, body, t0, tr, fwd)
        )
        if isinstance(admitted, RouterError):
            if tr is not None:
                _traced_end(tr, admitted)
            return dialect.refusal(admitted)
        ticket = admitted.ticket
        try:
            resp = await serve(ctx, request, admitted)
        except BaseException as e:
            if tr is not None:
                # Cancelled: the client went away; anything else is the router's own failure (a 500).
                gone = isinstance(e, asyncio.CancelledError)
                tr.finish(None if gone else 500, None if gone else type(e).__name__)
            raise
        finally:
            if ticket is not None:
                ticket.release()
        if tr is not None:
            _traced_end(tr, resp)
        return dialect.refusal(resp) if isinstance(resp, RouterError) else resp

    return handle


# ------------------------------------------------------------ admission


def _traced_end(tr: RequestTrace, answer: Answer) -> None:
    """The request's SERVER span ended with its answer; a refusal's reason is an event on it."""
    if isinstance(answer, RouterError):
        tr.event(
            "llmgw.refused", {"http.response.status_code": answer.status, "llmgw.reason": answer.message}
        )
    # The status the router counted, where it differs from the answer's (a stream whose client left).
    status = answer.status if tr.status is None else tr.status
    tr.finish(None if status == CLIENT_GONE else status)


def admit(
    ctx: RouterContext,
    route: Route,
    request: Request,
    rec: ApiKeyRecord | None,
    body: bytes,
    t0: float,
    tr: RequestTrace | None = None,
    fwd: bytes | None = None,
) -> Admitted | RouterError:
    """One parse, the catalog, the pin, the quota: the admitted request, or the refusal (counted here).
    ``tr``: the request's span (tracing on), told the model and a quota's refusal; ``fwd``: the trace
    context its engine is sent when it has no span (None: the client's, read here)."""
    metrics = ctx.metrics
    dialect = route.dialect
    parsed = dialect.parse(body, request)
    if isinstance(parsed, RouterError):
        metrics.request(UNKNOWN_MODEL, 400)
        return parsed
    model, stream, req, content_type = parsed
    if tr is not None:
        tr.admitted(model, rec.id if rec is not None else ANONYMOUS, stream)
    pool = ctx.pool
    profile = pool.profiles.get(model)
    adapter = None
    if profile is None and model in pool.adapters:
        # A LoRA adapter is a model to its clients: its own name in keys, limits and usage; its base's
        # profile for what it serves and how (issue 33).
        adapter = model
        profile = pool.profiles.get(pool.adapters[model].base)
    if profile is None or not allows_model(rec, model):
        metrics.request(UNKNOWN_MODEL, 404)
        return error_response(404, not_found_message(model), param="model")
    if route.api not in profile.served:
        metrics.request(model, 404)
        what = ", ".join(sorted(a.value for a in profile.served)) or "nothing"
        return error_response(
            404,
            f"model {model!r} does not serve POST {route.path} ({route.api.value}); it serves: {what}",
            param="model",
            code="unsupported_endpoint",
        )
    pin = dialect.pin(pool, profile.name, req)
    rewrite = pin is not None  # the body names the stored response as its engine made it
    if isinstance(pin, RouterError):
        metrics.request(model, pin.status)
        return pin
    prefix = None
    if dialect.salted and req is not None:
        before = req.get("cache_salt")
        salt = salt_for(rec, req)
        if isinstance(salt, RouterError):
            metrics.request(model, 400)
            return salt
        rewrite = rewrite or salt != before
        if dialect.prompted and ctx.cache is not None and pin is None:
            # An adapter's blocks are its own (vLLM salts their hashes with its name), on its base's index.
            prefix = ctx.cache.prefix(profile.name, req, request_salt(adapter, salt))
    if rewrite:
        body = json.dumps(req).encode()
    ticket = None
    if rec is not None and rec.limited:
        # The key's (and its team's) limits, before the model's gate: a tenant over its own limit is
        # refused at once with 429 (quota.py), never held, queued nor answered 503.
        admitted = ctx.quota.admit(rec, model, ctx.clock())
        if isinstance(admitted, RouterError):
            metrics.request(model, 429)
            if tr is not None:
                tr.event("llmgw.quota.refused", {"llmgw.key_id": rec.id, "llmgw.reason": admitted.message})
            return admitted
        ticket = admitted
    return Admitted(
        dialect,
        rec,
        rec.id if rec is not None else ANONYMOUS,
        model,
        profile,
        b"POST",
        route.path,
        body,
        content_type,
        req,
        stream,
        stream and dialect.usage_wanted(req),
        prompt_key(req) if ctx.limits.prefix_affinity and req is not None else None,
        prefix,
        pin,
        ticket,
        t0,
        adapter,
        profile.name,
        tr,
        b"" if tr is not None else forwarded(request) if fwd is None else fwd,
    )


def whole_body(ctx: RouterContext, request: Request) -> bytes | RouterError | None:
    """The body when it arrived with the headers (the usual case: taken in one call, not a read loop of
    two awaits and a copy), the refusal of a body over the limit, or None when it is still coming."""
    limit = ctx.limits.max_body_bytes
    cl = request.content_length
    if cl is not None and cl > limit:
        ctx.metrics.request(UNKNOWN_MODEL, 413)
        return _too_large(limit)
    content = request.content
    if content.is_eof():
        body = content.read_nowait()
        return _too_large(limit) if len(body) > limit else body
    return None


async def read_body(ctx: RouterContext, request: Request) -> bytes | RouterError:
    """The rest of a body still coming, within the size and time limits, or the refusal."""
    limit = ctx.limits.max_body_bytes
    try:
        async with asyncio.timeout(ctx.limits.body_timeout_s):
            return await request.read()
    except HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit
        return _too_large(limit)
    except TimeoutError:
        # A body that trickles in holds a connection and a handler: answer while we still can.
        ctx.metrics.request(UNKNOWN_MODEL, 408)
        return RouterError(
            408, f"the request body did not arrive within {ctx.limits.body_timeout_s:g}s", close=True
        )


def _too_large(limit: int) -> RouterError:
    return error_response(413, f"the request body exceeds the limit of {limit} bytes")


# ------------------------------------------------------------ held, gated, answered


async def serve(ctx: RouterContext, request: Request, a: Admitted) -> Answer:
    """Held while no replica is ready, through the model's gate, answered; the status counted once."""
    assert a.profile is not None
    metrics, holding, model = ctx.metrics, ctx.holding, a.model
    gate = ctx.gates.of(a.profile)
    started = None
    if model not in ctx.pool.ready and a.pin is None:
        # No ready replica: held while one is coming or waking (holding.py), else 503 and why.
        held = await holding.hold(request, a.profile, gate, a.stream, a.dialect, model, a.trace)
        if held.answer is not None:
            return held.answer
        started = held.started
    if not gate.try_enter():
        waited = time.perf_counter()
        ahead = gate.queued
        # An adapter shares its base's gate (the base's engines run it): its own count of the queue.
        queued = metrics.adapter_queued if a.adapter is not None else None
        if queued is not None:
            queued[model] = queued.get(model, 0) + 1
        try:
            # Served across keys by weight, not first come (admission.py).
            rec = a.record
            await gate.enter(rec.id, rec.weight) if rec is not None else await gate.enter()
        except AdmissionRefused as e:
            metrics.request(model, 429)
            refused = error_response(429, e.reason, retry_after=e.retry_after)
            return refused if started is None else await holding.finish(started, refused, a.dialect)
        finally:
            if queued is not None:
                queued[model] -= 1
            if a.trace is not None:
                _trace_gate(a.trace, a.record, gate, ahead, time.perf_counter() - waited)
    status: int | None = CLIENT_GONE
    try:
        if a.ticket is not None:
            a.ticket.sent = True
        resp, status = await answer(ctx, request, a, gate, started)
        return resp if started is None else await holding.finish(started, resp, a.dialect)
    finally:
        gate.leave()
        if status is not None:
            metrics.request(model, status, time.perf_counter() - a.t0)
            if a.trace is not None:
                a.trace.status = status


def _trace_gate(tr: RequestTrace, rec: ApiKeyRecord | None, gate: Gate, ahead: int, seconds: float) -> None:
    """The wait at the model's gate: in its queue fair across keys by weight (a keyed request), or in
    plain admission (no key: auth off)."""
    attrs: dict[str, str | int | float] = {"llmgw.waited_s": seconds, "llmgw.queued_ahead": ahead}
    if gate.limit is not None:
        attrs["llmgw.concurrency_limit"] = gate.limit
    if rec is None:
        tr.event("llmgw.admission.wait", attrs)
    else:
        attrs["llmgw.key_id"], attrs["llmgw.weight"] = rec.id, rec.weight
        tr.event("llmgw.fair_queue.wait", attrs)


async def answer(
    ctx: RouterContext,
    request: Request,
    a: Admitted,
    gate: Gate | None = None,
    started: StreamResponse | None = None,
) -> tuple[Answer, int | None]:
    """The one loop: an endpoint picked for each go, every endpoint tried kept in one list. The answer,
    and the status to record (None: counted already)."""
    limits, model = ctx.limits, a.model
    # The endpoints' model (an adapter's base), and the adapter they must hold.
    route, adapter = a.base or model, a.adapter
    tried: list[EndpointState] = []
    failed: list[_Failed] = []
    # The stream's failover (None when it is not continued: not a stream, or its dialect's is not).
    mig = Migration.of(a.dialect.continuation, a.json, a.profile, limits.max_migrations)
    broken: _Broken | None = None
    # Every replica refused the connection: the table is likely stale; waited for once.
    stale_wait = limits.refused_wait_s if a.pin is None and started is None else 0.0
    # Every replica said to hold the adapter answered that it has not (unloaded since, or restarted):
    # held again, once, as a request for an adapter loaded nowhere is.
    rehold = adapter is not None and a.pin is None
    moves = 0
    step: Continue | Close | Refuse | None = None
    while True:
        if broken is not None:
            # A stream broken after its first byte: what continues it, before any endpoint is asked.
            assert mig is not None
            step = mig.plan()
            if isinstance(step, Refuse):
                ctx.metrics.migration(model, "unsupported")
                log.warning(
                    "stream of %s broke (%s) and cannot be continued: %s", model, broken.why, step.reason
                )
                return broken.resp, 502
            if isinstance(step, Close):
                if not await close_with(broken.resp, step.tail):
                    return broken.resp, CLIENT_GONE
                return _continued(ctx, a, mig, broken), 200
            # A continuation goes to the replica holding most of prompt plus delivered text, by load
            # where the model does not route by cached prefix.
            ep = (
                None
                if moves == limits.max_migrations
                else pick(
                    ctx.pool,
                    ctx.choosing,
                    route,
                    tried,
                    ctx.clock(),
                    prefix=_prefix_of(ctx, a, step),
                    adapter=adapter,
                )
            )
        elif len(tried) > limits.retries:
            ep = None
        else:
            ep = pick(ctx.pool, ctx.choosing, route, tried, ctx.clock(), a.affinity, a.pin, a.prefix, adapter)
        if ep is None:
            if broken is None and stale_wait and tried and all(f.refused for f in failed):
                # Every replica the table names refused the connection: the table is likely stale (a
                # warm start's, read before any control plane rewrote it; replicas moved while this
                # router was cut off). Nothing was sent, so on the next table's endpoints it goes again
                # (issue 25: a warm `compose up` answered 502 three times before its first 200),
                # keeping its place in the gate.
                wait, stale_wait = stale_wait, 0.0
                if a.trace is not None:
                    a.trace.event(
                        "llmgw.stale_table.wait", {"llmgw.refused": len(tried), "llmgw.limit_s": wait}
                    )
                if await ctx.holding.next_endpoints(ctx.pool.endpoints_version, wait):
                    tried, failed = [], []
                    if model not in ctx.pool.ready and gate is not None and a.profile is not None:
                        # A model on its way in the new table is held like any other (without a
                        # stream's comments: its answer has not begun, and goes on not begun).
                        held = await ctx.holding.hold(
                            request, a.profile, gate, False, a.dialect, model, a.trace
                        )
                        if held.answer is not None:
                            return held.answer, None  # counted by the hold
                    continue
            if broken is None and rehold and failed and all(f.missing for f in failed):
                rehold = False
                if gate is not None and a.profile is not None:
                    held = await ctx.holding.hold(request, a.profile, gate, False, a.dialect, model)
                    if held.answer is not None:
                        return held.answer, None  # counted by the hold; a begun stream ended by serve()
                    tried, failed = [], []
                    continue
            break
        tried.append(ep)
        if broken is None:
            if len(tried) > 1:
                ctx.metrics.retry(model)
            if a.trace is None:
                got = await attempt(ctx, request, a, ep, started, mig)
            else:
                got = await _traced_attempt(ctx, request, a, a.trace, ep, started, mig, failed)
            if isinstance(got, _Failed):
                failed.append(got)
                log.debug("attempt %d on %s failed before the first byte: %s", len(tried), ep.url, got.why)
                continue
            if isinstance(got, _Broken):
                broken = got
                assert mig is not None
                if mig.barred is not None:
                    ctx.metrics.migration(model, mig.barred.value)
                    log.warning(
                        "stream of %s broke after the first byte (%s); failover %s",
                        model,
                        got.why,
                        mig.barred.value,
                    )
                    return got.resp, 502
                continue
            return got
        assert mig is not None and ctx.upstream is not None and isinstance(step, Continue)
        moves += 1
        log.info(
            "stream of %s broke (%s): continuing on %s (migration %d)",
            model,
            broken.why,
            ep.replica_id,
            moves,
        )
        if a.trace is None:
            done = await continue_on(
                ctx.upstream, ep, a.path, step.body, mig, broken.resp, ctx.clock, a.forward
            )
        else:
            done = await _traced_continuation(ctx, a, a.trace, ep, step, mig, broken, moves)
        if done is True:
            return _continued(ctx, a, mig, broken), 200
        if done is False:
            return broken.resp, CLIENT_GONE
        broken = broken._replace(why=done)
    if broken is not None:
        ctx.metrics.migration(model, "failed")
        log.warning("stream of %s broke and no replica continued it: %s", model, broken.why)
        return broken.resp, 502
    return _unanswered(ctx, a, tried, failed)


async def _traced_attempt(
    ctx: RouterContext,
    request: Request,
    a: Admitted,
    tr: RequestTrace,
    ep: EndpointState,
    started: StreamResponse | None,
    mig: Migration | None,
    failed: list[_Failed],
) -> tuple[Answer, int] | _Failed | _Broken:
    """:func:`attempt` in a CLIENT span (tracing on); a retry is an event on the request's span."""
    if tr.attempts:
        why = failed[-1].why if failed else ""
        tr.event(
            "llmgw.retry",
            {"llmgw.attempt": tr.attempts + 1, "llmgw.replica": ep.replica_id, "llmgw.reason": why},
        )
    span = tr.attempt(ep, a.model)
    try:
        got = await attempt(ctx, request, a, ep, started, mig, span)
    except BaseException:
        span.end(None, "cancelled")
        raise
    if isinstance(got, _Failed):
        span.end(got.status, None if got.status else ("connection_refused" if got.refused else "no_answer"))
    elif isinstance(got, _Broken):
        tr.event("llmgw.stream.broken", {"llmgw.replica": ep.replica_id, "llmgw.reason": got.why})
        span.end(200, "stream_broken")
    else:
        span.end(got[1], "client_gone" if got[1] == CLIENT_GONE else None)
    return got


async def _traced_continuation(
    ctx: RouterContext,
    a: Admitted,
    tr: RequestTrace,
    ep: EndpointState,
    step: Continue,
    mig: Migration,
    broken: _Broken,
    move: int,
) -> bool | str:
    """:func:`continue_on` in a CLIENT span, after a migration event: where the stream was broken (what
    the client had: characters and events of text), which replica continues it."""
    sent = mig.relay.sent
    tr.event(
        "llmgw.migration",
        {
            "llmgw.migration": move,
            "llmgw.offset_chars": sent.chars,
            "llmgw.offset_tokens": sent.tokens,
            "llmgw.replica": ep.replica_id,
            "llmgw.reason": broken.why,
        },
    )
    span = tr.attempt(ep, a.model, continuation=True)
    assert ctx.upstream is not None
    try:
        done = await continue_on(
            ctx.upstream, ep, a.path, step.body, mig, broken.resp, ctx.clock, span.headers
        )
    except BaseException:
        span.end(None, "cancelled")
        raise
    if done is True:
        span.used(mig.relay.sent.usage)
        span.end(200)
    else:
        span.end(None, "client_gone" if done is False else "continuation_failed")
    return done


def _prefix_of(ctx: RouterContext, a: Admitted, step: Continue) -> Prefix | None:
    """The continuation's prompt (the request with the text delivered so far) as cached blocks, where
    the request had a prefix (a rare path: one more parse of a body the router made)."""
    if a.prefix is None or ctx.cache is None:
        return None
    req = json.loads(step.body)
    salt = req.get("cache_salt")
    return ctx.cache.prefix(
        a.base or a.model, req, request_salt(a.adapter, salt if isinstance(salt, str) else None)
    )


def _continued(ctx: RouterContext, a: Admitted, mig: Migration, broken: _Broken) -> StreamResponse:
    """A broken stream ended whole: counted, and billed what the client was sent (written after its
    end, not before: docs/tenancy.md, "Usage that lasts")."""
    ctx.metrics.migration(a.model, "ok")
    ctx.usage.add(a.key_id, a.model, mig.relay.sent.usage if a.want_usage else None, broken.streamed)
    return broken.resp


def _unanswered(
    ctx: RouterContext, a: Admitted, tried: list[EndpointState], failed: list[_Failed]
) -> tuple[RouterError, int]:
    """No answer from any endpoint: why, as a 503 (none may be tried, or every one said it cannot serve
    now) or a 502."""
    model = a.model
    if not tried:
        if a.pin is not None:
            why = (
                f"replica {a.pin.replica_id}, which stores the response asked for, is failing (circuit open)"
            )
            return error_response(503, why, retry_after=1), 503
        return error_response(503, ctx.pool.why_unavailable(model, ctx.clock()), retry_after=1), 503
    n = len(tried)
    problem = failed[-1].why if failed else ""
    msg = f"model {model!r}: {n} attempt{'s' if n > 1 else ''} failed before an answer: {problem}"
    if failed and all(f.status == 503 or f.missing for f in failed):
        # Every replica said it cannot serve now (loading, overloaded, the adapter not loaded):
        # unavailable, not broken.
        return error_response(503, msg, retry_after=1), 503
    return error_response(502, msg), 502


# ------------------------------------------------------------ one endpoint


async def attempt(
    ctx: RouterContext,
    request: Request,
    a: Admitted,
    ep: EndpointState,
    started: StreamResponse | None,
    mig: Migration | None,
    span: AttemptSpan | None = None,
) -> tuple[Answer, int] | _Failed | _Broken:
    """Ask ``ep``: the answer and the status to record, why it failed before anything reached the
    client, or the stream it broke after its first byte. The endpoint's in-flight count and breaker
    are kept here, whatever the outcome. ``span``: this attempt's (tracing on), told the model that
    answered and the usage."""
    assert ctx.upstream is not None
    metrics = ctx.metrics
    ctx.idle.stamp(ep.replica_id, ctx.clock())
    ep.in_flight += 1
    metrics.in_flight += 1
    adapter = a.adapter
    if adapter is not None:
        metrics.adapter_in_flight[adapter] = metrics.adapter_in_flight.get(adapter, 0) + 1
    verdict: bool | None = None  # breaker outcome: True success, False failure, None unknown
    up = None
    try:
        up = await ctx.upstream.post(
            ep.url,
            a.path,
            a.body,
            a.content_type,
            held=ep.answers,
            method=a.method,
            extra=a.forward if span is None else span.headers,
        )
        # Withdrawing the endpoint aborts the answer (migration.abort_withdrawn): retried or continued
        # elsewhere.
        ep.answers.add(up)
        status = up.status
        if status in RETRY_STATUSES and a.pin is None:
            try:
                detail = (await up.readany())[:300].decode("utf-8", "replace")
            except UpstreamError:
                detail = ""
            verdict = False
            return _Failed(f"{ep.replica_id} answered {status}: {detail}", status)
        if status == 404 and adapter is not None and a.pin is None:
            # Its report said it holds the adapter; its engine says it has no such model: unloaded since,
            # or restarted. Not a holder until a report says so again; the engine itself is well.
            try:
                detail = (await up.readany())[:300].decode("utf-8", "replace")
            except UpstreamError:
                detail = ""
            ctx.pool.forget_adapter(ep, adapter)
            verdict = True
            return _Failed(
                f"{ep.replica_id} has not adapter {adapter!r} loaded: {detail}", status, missing=True
            )
        # The header lines to relay, and the answer's Content-Type and Content-Length, in one pass.
        lines, ctype, clen = relay_lines(up.headers, _DROP_RAW)
        ticket = a.ticket
        if ticket is not None:
            # OpenAI sends its x-ratelimit-* on every answer, not only on a 429.
            lines += ticket.header_lines(ctx.clock())
        if clen is not None and clen.isdigit() and not (ctype or b"").startswith(b"text/event-stream"):
            # Taken as it is when it is all here (no read coroutine), else read to its end.
            data = up.take_whole()
            if data is None:
                data = await up.read()
            verdict = status < 500
            elapsed = time.perf_counter() - a.t0
            ep.observe_latency(elapsed)
            metrics.first_byte(a.model, elapsed)
            if status < 300:
                # Counted before the client has the answer; written behind it (tenancy/ledger.py).
                ctx.usage.add(a.key_id, a.model, find_usage(data))
                if span is not None:
                    span.answered(data)
                    span.used(find_usage(data))
                data = a.dialect.rewrite(data, ep.tag)
            return RelayedResponse(status, data, lines, ctype is not None), status
        got = await _stream(ctx, request, up, ep, a, status < 500, started, mig, lines, span)
        if isinstance(got, (_Failed, _Broken)):
            # A broken stream's failure is said now, not when its continuation ends: others should not
            # be sent to it meanwhile.
            verdict = False
            return got
        resp, status, verdict = got
        return resp, status
    except ReadTimeout:
        verdict = False
        return error_response(504, f"{ep.replica_id} did not answer in time"), 504
    except UpstreamError as e:
        verdict = False
        if up is None:  # ConnectFailed, Disconnected: nothing came back
            return _Failed(f"{ep.replica_id}: {e}", refused=isinstance(e, ConnectFailed))
        return _Failed(f"{ep.replica_id}: answer cut short: {e}")
    finally:
        ep.in_flight -= 1
        metrics.in_flight -= 1
        if adapter is not None:
            metrics.adapter_in_flight[adapter] -= 1
        if up is not None:
            ep.answers.discard(up)
            up.close()  # no-op after a full read; drops the connection after a partial one
        if verdict is True:
            ep.breaker.success()
        elif verdict is False:
            ep.breaker.failure(ctx.clock())
        else:
            ep.breaker.abandon()


async def _stream(
    ctx: RouterContext,
    request: Request,
    up: UpstreamResponse,
    ep: EndpointState,
    a: Admitted,
    verdict: bool,
    started: StreamResponse | None,
    mig: Migration | None,
    lines: bytes,
    span: AttemptSpan | None = None,
) -> tuple[Answer, int, bool | None] | _Failed | _Broken:
    """A streamed answer relayed as it comes; ``lines``: the engine's header lines to relay."""
    status = up.status
    model, key_id, want_usage = a.model, a.key_id, a.want_usage
    try:
        first = await up.readany()
    except ReadTimeout:
        return _gateway_timeout(ep), 504, False
    except UpstreamError as e:
        return _Failed(f"{ep.replica_id}: stream ended before its first byte: {e}")
    ctx.metrics.first_byte(model, time.perf_counter() - a.t0)
    if span is not None:
        span.answered(first)
    if verdict:
        # The engine answers: say so now, not when the stream ends. A half-open breaker lets one probe
        # through at a time, so a long stream as the probe would keep the endpoint shut for its length.
        ep.breaker.success()
    if started is None:
        resp = StreamResponse(status=status)
        resp.raw_headers = lines
    else:
        resp = started
    tagger = a.dialect.tagger(ep.tag) if status < 300 else None
    if mig is not None and status != 200:
        mig = None
    tail = b""
    # Events streamed, each taken as one completion token meanwhile: a long stream weighs on its
    # key's tokens per minute while it runs; the answer's usage settles the count (usage.add).
    metered = a.ticket is not None and status < 300
    streamed = 0
    # Events relayed so far (any key): what a stream whose client left is billed as completion tokens.
    relayed = 0
    added = False

    def client_left() -> tuple[Answer, int, bool | None]:
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
            sent = chunk if mig is None else mig.relay_bytes(chunk)
            if want_usage:
                tail = (tail + sent)[-TAIL_BYTES:] if len(sent) < TAIL_BYTES else sent[-TAIL_BYTES:]
            events = sent.count(b"data: {")
            relayed += events
            if metered and events:
                streamed += events
                ctx.quota.add_tokens(key_id, model, events, ctx.clock())
            try:
                if not chunk or up.at_eof():
                    if mig is not None and not mig.complete():
                        raise UpstreamError("the stream ended without [DONE]")
                    if tagger is not None:
                        sent = tagger.feed(sent) + tagger.flush()
                    if status < 300:
                        # Counted before the client has the stream's end; written behind it (ledger.py).
                        ctx.usage.add(key_id, model, find_usage(tail) if want_usage else None, streamed)
                        added = True
                        if span is not None and want_usage:
                            span.used(find_usage(tail))
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
        # Mostly the client hanging up (its handler is cancelled, see http/connection.py).
        client_left()
        raise
    except UpstreamError as e:
        # The engine failed after the first byte: continued elsewhere (the loop), or the client's end.
        up.close()
        if mig is None:
            log.warning("stream from %s broke after the first byte: %s", ep.replica_id, e)
            return resp, 502, False
        return _Broken(resp, f"{ep.replica_id}: {e}", streamed)
    ep.observe_latency(time.perf_counter() - a.t0)
    return resp, status, verdict


def _gateway_timeout(ep: EndpointState) -> RouterError:
    return error_response(504, f"{ep.replica_id} did not answer in time")
