"""The handler of every proxied route (``routes.py``): the key, the body read within its limits, one
parse for ``model`` and ``stream`` (JSON, or a form's fields), the catalog check and what the model
serves, a stored response's replica pinned, the key's quota, holding while no replica is ready, the
model's admission gate, then :func:`llmgw_router.proxy.forward`. Nothing here touches NATS.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from llmgw_common.apis import Api
from llmgw_router.context import RouterContext
from llmgw_router.dialects.forms import form_fields
from llmgw_router.dialects.routes import BodyKind, Dialect, Route
from llmgw_router.dialects.stored import untag
from llmgw_router.errors import CLIENT_GONE, Answer, RouterError, error_response
from llmgw_router.http.request import HTTPRequestEntityTooLarge, Request
from llmgw_router.proxy import Outbound, forward, parse_request
from llmgw_router.refusals import gone, not_found_message
from llmgw_router.routing.affinity import prompt_key
from llmgw_router.routing.endpoints import EndpointState
from llmgw_router.tenancy.admission import AdmissionRefused
from llmgw_router.tenancy.auth import request_key
from llmgw_router.tenancy.keycheck import ANONYMOUS, Handler
from llmgw_router.tenancy.keys import allows_model

# Metrics label for model names that are not in the catalog (client-chosen: unbounded otherwise).
UNKNOWN_MODEL = "-"


def too_large(ctx: RouterContext) -> RouterError:
    return error_response(413, f"the request body exceeds the limit of {ctx.limits.max_body_bytes} bytes")


def unsupported(model: str, route: Route, served: frozenset[Api]) -> RouterError:
    what = ", ".join(sorted(a.value for a in served)) or "nothing"
    return error_response(
        404,
        f"model {model!r} does not serve POST {route.path} ({route.api.value}); it serves: {what}",
        param="model",
        code="unsupported_endpoint",
    )


def pin_previous(
    ctx: RouterContext, parsed: dict[str, Any], model: str
) -> tuple[EndpointState | None, RouterError | None]:
    """The replica storing ``previous_response_id``, with the id in the body made the engine's own."""
    prev = parsed.get("previous_response_id")
    found = untag(prev) if isinstance(prev, str) else None
    if found is None:
        return None, None
    assert isinstance(prev, str)
    ep = ctx.pool.by_tag.get(found[0])
    if ep is None:
        return None, gone(prev)
    if ep.model != model:
        return None, error_response(
            400,
            f"previous_response_id {prev!r} was made by model {ep.model!r}, not {model!r}",
            param="previous_response_id",
        )
    parsed["previous_response_id"] = found[1]
    return ep, None


async def read_body(ctx: RouterContext, request: Request) -> bytes | RouterError:
    """The whole body within the size and time limits, or the refusal."""
    cl = request.content_length
    if cl is not None and cl > ctx.limits.max_body_bytes:
        ctx.metrics.request(UNKNOWN_MODEL, 413)
        return too_large(ctx)
    content = request.content
    if content.is_eof():
        # The whole body arrived with the headers (the usual case): take it in one call instead of
        # a read loop (two awaits and a copy), with the same size limit.
        body = content.read_nowait()
        if len(body) > ctx.limits.max_body_bytes:
            return too_large(ctx)
        return body
    try:
        async with asyncio.timeout(ctx.limits.body_timeout_s):
            return await request.read()
    except HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit
        return too_large(ctx)
    except TimeoutError:
        # A body that trickles in holds a connection and a handler: answer while we still can.
        ctx.metrics.request(UNKNOWN_MODEL, 408)
        return RouterError(
            408, f"the request body did not arrive within {ctx.limits.body_timeout_s:g}s", close=True
        )


def make_proxy_handler(ctx: RouterContext, route: Route) -> Handler:
    metrics = ctx.metrics
    path = route.path
    form = route.body is BodyKind.MULTIPART
    # Their streams always end with usage (response.completed, message_delta): no option asks for it.
    usage_always = route.api in (Api.RESPONSES, Api.MESSAGES)
    anthropic = route.dialect is Dialect.ANTHROPIC

    async def handle(request: Request) -> Answer:
        t0 = time.perf_counter()
        # keycheck.authenticate, with the record kept here: nothing else reads it from a proxied request.
        rec = None
        if ctx.auth and not ctx.exemptions.exempt(request.path):
            check = ctx.keys.check(request_key(request), ctx.clock())
            rec = check.record
            if rec is None:
                return error_response(401, check.problem or "invalid API key")
        body = await read_body(ctx, request)
        if isinstance(body, RouterError):
            return body
        parsed: dict[str, Any] | None = None
        content_type = b"application/json"
        if form:
            ctype = request.header(b"content-type")
            fields = form_fields(body, ctype)
            if isinstance(fields, str):
                metrics.request(UNKNOWN_MODEL, 400)
                return error_response(400, fields, param="model" if "model" in fields else None)
            assert ctype is not None
            model, stream = fields["model"], fields.get("stream", "").lower() == "true"
            content_type = ctype.encode("latin-1", "replace")
        else:
            got = parse_request(body)
            if isinstance(got, str):
                metrics.request(UNKNOWN_MODEL, 400)
                return error_response(400, got, param=None if "JSON" in got else "model")
            parsed = got
            model, stream = parsed["model"], parsed.get("stream") is True
        profile = ctx.pool.profiles.get(model)
        if profile is None or not allows_model(rec, model):
            metrics.request(UNKNOWN_MODEL, 404)
            return error_response(404, not_found_message(model), param="model")
        if route.api not in profile.served:
            metrics.request(model, 404)
            return unsupported(model, route, profile.served)
        pin = None
        if route.stores and parsed is not None:
            pin, refused = pin_previous(ctx, parsed, model)
            if refused is not None:
                metrics.request(model, refused.status)
                return refused
            if pin is not None:
                body = json.dumps(parsed).encode()
        want_usage = False
        if stream:
            so = parsed.get("stream_options") if parsed is not None else None
            want_usage = usage_always or (isinstance(so, dict) and so.get("include_usage") is True)
        ticket = None
        if rec is not None and rec.limited:
            # The key's (and its team's) limits, before the model's gate: a tenant over its own limit
            # is refused at once with 429 (quota.py), never held, queued nor answered 503.
            admitted = ctx.quota.admit(rec, model, ctx.clock())
            if isinstance(admitted, RouterError):
                metrics.request(model, 429)
                return admitted
            ticket = admitted

        async def turn(last: bool) -> tuple[Answer, bool]:
            """Held while no replica is ready, admitted, forwarded; the answer, and (when not ``last``)
            whether every replica named refused the connection: nothing was sent, the table is likely
            stale, and the answer (a 502) is not counted yet."""
            gate = ctx.gate(profile)
            started = None
            if model not in ctx.pool.ready and pin is None:
                # No ready replica: held while one is coming or waking (holding.py), else 503 and why.
                held = await ctx.holding.hold(request, profile, gate, stream, anthropic)
                if held.answer is not None:
                    return held.answer, False
                started = held.started
            if not gate.try_enter():
                try:
                    # Served across keys by weight, not first come (admission.py).
                    await gate.enter(rec.id, rec.weight) if rec is not None else await gate.enter()
                except AdmissionRefused as e:
                    metrics.request(model, 429)
                    refused = error_response(429, e.reason, retry_after=e.retry_after)
                    if started is None:
                        return refused, False
                    return await ctx.holding.finish(started, refused, anthropic), False
            status: int | None = CLIENT_GONE
            try:
                key_id = rec.id if rec is not None else ANONYMOUS
                affinity = prompt_key(parsed) if ctx.limits.prefix_affinity and parsed is not None else None
                out = Outbound(
                    path, body, model, key_id, want_usage, parsed, started, affinity, pin, route.stores
                )
                out.content_type = content_type
                if ticket is not None:
                    ticket.sent = True
                    # OpenAI sends its x-ratelimit-* on every answer, not only on a 429.
                    out.extra_lines = ticket.header_lines(ctx.clock())
                    out.metered = True
                resp, status = await forward(ctx, request, out)
                if out.refused_everywhere and started is None and not last:
                    status = None  # counted once, by whichever answer the client gets
                    return resp, True
                return (
                    resp if started is None else await ctx.holding.finish(started, resp, anthropic)
                ), False
            finally:
                gate.leave()
                if status is not None:
                    metrics.request(model, status, time.perf_counter() - t0)

        try:
            resp, stale = await turn(last=pin is not None or not ctx.limits.refused_wait_s)
            if stale:
                # Every replica the table names refused the connection: the table is likely stale (a
                # warm start's, read before any control plane rewrote it; replicas moved while this
                # router was cut off). Nothing was sent, so on the next table's endpoints it goes
                # again; a model on its way is then held like any other (issue 25: a warm
                # `compose up` answered 502 three times before its first 200).
                version = ctx.pool.endpoints_version
                if await ctx.holding.next_endpoints(version, ctx.limits.refused_wait_s):
                    resp, _ = await turn(last=True)
                else:
                    metrics.request(model, resp.status, time.perf_counter() - t0)
            return resp
        finally:
            if ticket is not None:
                ticket.release()

    return handle
