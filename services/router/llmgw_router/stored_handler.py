"""The stored-response routes: ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``,
sent to the replica storing the response (its id names it: ``dialects/stored.py``), through the request path's one loop (``proxy.py``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from llmgw_common.messages import ApiKeyRecord
from llmgw_router.context import RouterContext
from llmgw_router.dialects.dialect import RESPONSES
from llmgw_router.dialects.routes import CANCEL_SUFFIX, STORED_PREFIX
from llmgw_router.dialects.stored import untag
from llmgw_router.errors import CLIENT_GONE, Answer, error_response
from llmgw_router.http.request import Request
from llmgw_router.proxy import Admitted, answer
from llmgw_router.refusals import gone
from llmgw_router.tenancy.keycheck import ANONYMOUS, request_record
from llmgw_router.tenancy.keys import allows_model


def _allows_replica(ctx: RouterContext, rec: ApiKeyRecord | None, model: str) -> bool:
    """Whether the key may read a response stored by a replica of ``model``: allowed the model, or one
    of its LoRA adapters (a response made for an adapter is stored by a replica of its base; its id names
    the replica only)."""
    if allows_model(rec, model):
        return True
    return any(a.base == model and allows_model(rec, a.name) for a in ctx.pool.adapters.values())


def make_stored_handler(ctx: RouterContext) -> Callable[[Request, bool], Awaitable[Answer]]:
    """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel, sent to the replica storing the
    response (its id names it: stored.py)."""

    async def handle(request: Request, cancel: bool) -> Answer:
        t0 = time.perf_counter()
        refused = ctx.keycheck.authenticate(request)
        if refused is not None:
            return refused
        rec = request_record(request)
        response_id = request.match_info["response_id"]
        found = untag(response_id)
        if found is None:
            return error_response(
                404,
                f"response {response_id!r} not found: llmgw's response ids name the replica that "
                "stores them, and this one names none",
                code="response_not_found",
            )
        ep = ctx.pool.by_tag.get(found[0])
        if ep is None or not _allows_replica(ctx, rec, ep.model):
            return gone(response_id)
        path = STORED_PREFIX + found[1] + (CANCEL_SUFFIX if cancel else "")
        if request.query_string:
            path += "?" + request.query_string
        admitted = Admitted(
            RESPONSES,
            rec,
            rec.id if rec is not None else ANONYMOUS,
            ep.model,
            None,
            b"POST" if cancel else b"GET",
            path,
            b"",
            b"application/json",
            None,
            False,
            False,
            None,
            None,
            ep,
            None,
            t0,
        )
        status: int | None = CLIENT_GONE
        try:
            resp, status = await answer(ctx, request, admitted)
            return resp
        finally:
            if status is not None:
                ctx.metrics.request(ep.model, status, time.perf_counter() - t0)

    return handle
