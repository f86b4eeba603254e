"""The router's HTTP surface: the OpenAI API, the landing page, health (metrics: ``admin.py``).

Per request: auth (a dict lookup), the body read with a size limit, one JSON parse for ``model`` and
``stream``, the catalog check, admission, then :func:`llmgw_router.proxy.forward`. Nothing here
touches NATS.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

from llmgw_common.messages import ApiKeyRecord
from llmgw_router import landing, web
from llmgw_router.admission import AdmissionRefused
from llmgw_router.affinity import prompt_key
from llmgw_router.auth import request_key
from llmgw_router.context import RouterContext
from llmgw_router.errors import error_response
from llmgw_router.keys import allows_model
from llmgw_router.proxy import CLIENT_GONE, forward, parse_request

KEY_RECORD = web.RequestKey("key", ApiKeyRecord)
# Requests without auth (static mode with auth off) count their usage under this key id.
ANONYMOUS = "-"
# Metrics label for model names that are not in the catalog (client-chosen: unbounded otherwise).
UNKNOWN_MODEL = "-"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _not_found_message(model: str) -> str:
    # One message for "not in the catalog" and "not allowed for your key", so a key cannot probe the
    # catalog (ARCHITECTURE #12 in spirit): both are 404 model_not_found, as OpenAI answers.
    return f"The model '{model}' does not exist or your API key may not use it"


def _authenticate(ctx: RouterContext, request: web.Request) -> web.Response | None:
    """The 401 answer for a request that needs a key and has no valid one; None when it may go on."""
    if ctx.auth and not ctx.exemptions.exempt(request.path):
        check = ctx.keys.check(request_key(request), ctx.clock())
        if check.record is None:
            return error_response(401, check.problem or "invalid API key")
        request[KEY_RECORD] = check.record
    return None


def _guarded(ctx: RouterContext, handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        refused = _authenticate(ctx, request)
        if refused is not None:
            return refused
        return await handler(request)

    return guarded


def _not_in_api(status: int) -> Handler:
    async def answer(request: web.Request) -> web.Response:
        return error_response(
            status,
            f"{request.method} {request.path} is not part of this API",
            code="not_found" if status == 404 else None,
        )

    return answer


def build_app(ctx: RouterContext) -> Handler:
    """The OpenAI listener's one handler: dispatch on the path, then the method.

    Every route checks the key first (the same check for every path, exemptions included), and unknown
    paths and methods are answered after it too (405 for a known path with another method, else 404),
    as a middleware in front of the routes would order them. HEAD is answered as GET, without a body.
    """
    wrong_method = _guarded(ctx, _not_in_api(405))
    not_found = _guarded(ctx, _not_in_api(404))
    routes: dict[str, dict[str, Handler]] = {}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        routes[path] = {"POST": _make_proxy_handler(ctx, path)}
    for path, handler in (
        ("/v1/models", _make_models_handler(ctx)),
        ("/", _landing),
        ("/health", _health),
        ("/healthz", _health),
    ):
        g = _guarded(ctx, handler)
        routes[path] = {"GET": g, "HEAD": g}
    model = _guarded(ctx, _make_model_handler(ctx))
    models_prefix = "/v1/models/"

    async def dispatch(request: web.Request) -> web.StreamResponse:
        path = request.path
        methods = routes.get(path)
        if methods is None:
            if path.startswith(models_prefix) and len(path) > len(models_prefix):
                if request.method not in ("GET", "HEAD"):
                    return await wrong_method(request)
                request.match_info["model"] = path[len(models_prefix) :]
                return await model(request)
            return await not_found(request)
        handler = methods.get(request.method)
        if handler is None:
            return await wrong_method(request)
        return await handler(request)

    return dispatch


async def _health(_: web.Request) -> web.Response:
    return web.Response(text='{"status":"ok"}', content_type="application/json")


async def _landing(request: web.Request) -> web.Response:
    base = landing.display_base_url(request.headers, request.scheme, request.host)
    return web.Response(text=landing.render(base), content_type="text/html")


def _key(request: web.Request) -> ApiKeyRecord | None:
    return request.get(KEY_RECORD)


def _make_models_handler(ctx: RouterContext) -> Handler:
    async def models(request: web.Request) -> web.Response:
        rec = _key(request)
        created = int(ctx.started)
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "llmgw"}
            for name in ctx.pool.profiles
            if allows_model(rec, name)
        ]
        return web.Response(
            text=json.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    return models


def _make_model_handler(ctx: RouterContext) -> Handler:
    async def model(request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in ctx.pool.profiles or not allows_model(_key(request), name):
            return error_response(404, _not_found_message(name), param="model")
        body = {"id": name, "object": "model", "created": int(ctx.started), "owned_by": "llmgw"}
        return web.Response(text=json.dumps(body), content_type="application/json")

    return model


def _too_large(ctx: RouterContext) -> web.Response:
    return error_response(413, f"the request body exceeds the limit of {ctx.limits.max_body_bytes} bytes")


def _make_proxy_handler(ctx: RouterContext, path: str) -> Handler:
    metrics = ctx.metrics

    async def handle(request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        # _authenticate, with the record kept here: nothing else reads it from a proxied request.
        rec = None
        if ctx.auth and not ctx.exemptions.exempt(request.path):
            check = ctx.keys.check(request_key(request), ctx.clock())
            rec = check.record
            if rec is None:
                return error_response(401, check.problem or "invalid API key")
        cl = request.content_length
        if cl is not None and cl > ctx.limits.max_body_bytes:
            metrics.request(UNKNOWN_MODEL, 413)
            return _too_large(ctx)
        content = request.content
        if content.is_eof():
            # The whole body arrived with the headers (the usual case): take it in one call instead of
            # aiohttp's read loop (two awaits and a copy), with the same size limit.
            body = content.read_nowait()
            if len(body) > ctx.limits.max_body_bytes:
                return _too_large(ctx)
        else:
            try:
                async with asyncio.timeout(ctx.limits.body_timeout_s):
                    body = await request.read()
            except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit
                return _too_large(ctx)
            except TimeoutError:
                # A body that trickles in holds a connection and a handler: answer while we still can.
                metrics.request(UNKNOWN_MODEL, 408)
                late = error_response(
                    408, f"the request body did not arrive within {ctx.limits.body_timeout_s:g}s"
                )
                late.force_close()
                return late
        parsed = parse_request(body)
        if isinstance(parsed, str):
            metrics.request(UNKNOWN_MODEL, 400)
            return error_response(400, parsed, param=None if "JSON" in parsed else "model")
        model: str = parsed["model"]
        profile = ctx.pool.profiles.get(model)
        if profile is None or not allows_model(rec, model):
            metrics.request(UNKNOWN_MODEL, 404)
            return error_response(404, _not_found_message(model), param="model")
        want_usage = False
        if parsed.get("stream") is True:
            so = parsed.get("stream_options")
            want_usage = isinstance(so, dict) and so.get("include_usage") is True
        gate = ctx.gate(profile)
        started = None
        if model not in ctx.pool.ready:
            # No ready replica: held while one is coming or waking (holding.py), else 503 with the reason.
            held = await ctx.holding.hold(request, profile, gate, parsed.get("stream") is True)
            if held.answer is not None:
                return held.answer
            started = held.started
        if not gate.try_enter():
            try:
                await gate.enter()
            except AdmissionRefused as e:
                metrics.request(model, 429)
                refused = error_response(429, e.reason, retry_after=e.retry_after)
                return refused if started is None else await ctx.holding.finish(started, refused)
        status = CLIENT_GONE
        try:
            key_id = rec.id if rec is not None else ANONYMOUS
            affinity = prompt_key(parsed) if ctx.limits.prefix_affinity else None
            resp, status = await forward(
                ctx, request, path, body, model, key_id, want_usage, parsed, started, affinity
            )
            return resp if started is None else await ctx.holding.finish(started, resp)
        finally:
            gate.leave()
            metrics.request(model, status, time.perf_counter() - t0)

    return handle
