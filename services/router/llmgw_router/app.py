"""The router's HTTP surface: one handler dispatching on the path, then the method, to the proxied
routes (``routes.py``: the OpenAI API, the Responses API, Anthropic Messages, pooling, tokenizing,
audio; handled in ``proxy.py``), the stored responses (``stored_handler.py``) and the routes
answered here (``local_routes.py``: the catalog, the landing page, health). Every route checks the key
first (``keycheck.py``). Metrics are on the admin listener (``admin.py``). Nothing here touches NATS.
"""

from __future__ import annotations

from llmgw_router.context import RouterContext
from llmgw_router.dialects.dialect import Dialect
from llmgw_router.dialects.routes import CANCEL_SUFFIX, PROXIED, STORED_PREFIX
from llmgw_router.errors import Answer, RouterError, error_response
from llmgw_router.http.request import Request
from llmgw_router.http.response import StreamResponse
from llmgw_router.http.server import Handler as ServerHandler
from llmgw_router.local_routes import health, landing_page, make_model_handler, make_models_handler
from llmgw_router.proxy import make_proxy_handler
from llmgw_router.stored_handler import make_stored_handler
from llmgw_router.tenancy.keycheck import Handler


def _not_in_api(status: int) -> Handler:
    async def answer(request: Request) -> RouterError:
        return error_response(
            status,
            f"{request.method} {request.path} is not part of this API",
            code="not_found" if status == 404 else None,
        )

    return answer


def build_app(ctx: RouterContext) -> ServerHandler:
    """The OpenAI listener's one handler: dispatch on the path, then the method.

    Every route checks the key first (the same check for every path, exemptions included), and unknown
    paths and methods are answered after it too (405 for a known path with another method, else 404),
    as a middleware in front of the routes would order them. HEAD is answered as GET, without a body.
    """
    guarded = ctx.keycheck.guarded
    refuse_method = guarded(_not_in_api(405))
    not_found = guarded(_not_in_api(404))
    routes: dict[str, dict[str, Handler]] = {}
    # A proxied path's refusals take its dialect's shape (the proxy handler renders its own).
    dialects: dict[str, Dialect] = {}
    for route in PROXIED:
        routes[route.path] = {"POST": make_proxy_handler(ctx, route)}
        dialects[route.path] = route.dialect
    for path, handler in (
        ("/v1/models", make_models_handler(ctx)),
        ("/", landing_page),
        ("/health", health),
        ("/healthz", health),
    ):
        g = guarded(handler)
        routes[path] = {"GET": g, "HEAD": g}
    model = guarded(make_model_handler(ctx))
    stored = make_stored_handler(ctx)
    models_prefix = "/v1/models/"

    async def wrong_method(request: Request, allow: str) -> Answer:
        # RFC 9110 §15.5.6: a 405 says which methods the path has.
        resp = await refuse_method(request)
        if resp.status == 405:
            resp.headers["Allow"] = allow
        dialect = dialects.get(request.path)
        if dialect is not None and isinstance(resp, RouterError):
            return dialect.refusal(resp)
        return resp

    async def off_table(request: Request, path: str) -> Answer:
        """A path that is not a row of the table: a model, a stored response, or none."""
        if path.startswith(models_prefix) and len(path) > len(models_prefix):
            if request.method not in ("GET", "HEAD"):
                return await wrong_method(request, "GET, HEAD")
            request.match_info["model"] = path[len(models_prefix) :]
            return await model(request)
        if path.startswith(STORED_PREFIX):
            rest = path[len(STORED_PREFIX) :]
            cancel = rest.endswith(CANCEL_SUFFIX)
            if cancel:
                rest = rest[: -len(CANCEL_SUFFIX)]
            if rest and "/" not in rest:
                if request.method != ("POST" if cancel else "GET"):
                    return await wrong_method(request, "POST" if cancel else "GET")
                request.match_info["response_id"] = rest
                return await stored(request, cancel)
        return await not_found(request)

    async def dispatch(request: Request) -> StreamResponse:
        path = request.path
        methods = routes.get(path)
        if methods is None:
            resp = await off_table(request, path)
        else:
            handler = methods.get(request.method)
            resp = await (
                handler(request) if handler is not None else wrong_method(request, ", ".join(methods))
            )
        # A refusal its route's dialect did not render takes OpenAI's shape.
        return resp.response() if isinstance(resp, RouterError) else resp

    return dispatch
