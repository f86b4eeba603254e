"""The GET routes the router answers itself, without an engine: the catalog as the key sees it
(``/v1/models``, ``/v1/models/{model}``), the landing page and health."""

from __future__ import annotations

import json
from typing import Any

from llmgw_router import landing
from llmgw_router.context import RouterContext
from llmgw_router.errors import Answer, error_response
from llmgw_router.http.request import Request
from llmgw_router.http.response import Response
from llmgw_router.refusals import not_found_message
from llmgw_router.routing.endpoints import Pool
from llmgw_router.tenancy.keycheck import Handler, request_record
from llmgw_router.tenancy.keys import allows_model


async def health(_: Request) -> Response:
    return Response(text='{"status":"ok"}', content_type="application/json")


async def landing_page(request: Request) -> Response:
    base = landing.display_base_url(request.headers, request.scheme, request.host)
    # The page's URL comes from request headers: never kept by a shared cache for another client.
    return Response(
        text=landing.render(base), content_type="text/html", headers={"Cache-Control": "no-store"}
    )


def _card(pool: Pool, name: str, created: int) -> dict[str, Any] | None:
    """A model's entry in ``/v1/models``; a LoRA adapter's as vLLM lists one (``root`` its weights,
    ``parent`` its base), whether or not a replica holds it now: it is loaded when asked for. None for
    a name the catalog has not (or an adapter whose base it has not)."""
    if name in pool.profiles:
        return {"id": name, "object": "model", "created": created, "owned_by": "llmgw"}
    a = pool.adapters.get(name)
    if a is None or a.base not in pool.profiles:
        return None
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "llmgw",
        "root": a.weights,
        "parent": a.base,
    }


def make_models_handler(ctx: RouterContext) -> Handler:
    async def models(request: Request) -> Response:
        rec = request_record(request)
        created = int(ctx.started)
        pool = ctx.pool
        cards = (
            _card(pool, name, created) for name in (*pool.profiles, *pool.adapters) if allows_model(rec, name)
        )
        data = [c for c in cards if c is not None]
        return Response(text=json.dumps({"object": "list", "data": data}), content_type="application/json")

    return models


def make_model_handler(ctx: RouterContext) -> Handler:
    async def model(request: Request) -> Answer:
        name = request.match_info["model"]
        card = _card(ctx.pool, name, int(ctx.started))
        if card is None or not allows_model(request_record(request), name):
            return error_response(404, not_found_message(name), param="model")
        return Response(text=json.dumps(card), content_type="application/json")

    return model
