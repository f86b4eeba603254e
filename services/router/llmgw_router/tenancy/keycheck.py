"""The key check in front of every route: the same check for every path (exemptions included), the
record it found kept on the request for the handler, and the handler type the routes share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from llmgw_common.messages import ApiKeyRecord
from llmgw_router.context import RouterContext
from llmgw_router.errors import Answer, RouterError, error_response
from llmgw_router.http.request import Request, RequestKey
from llmgw_router.tenancy.auth import request_key

KEY_RECORD = RequestKey("key", ApiKeyRecord)
# Requests without auth (static mode with auth off) count their usage under this key id.
ANONYMOUS = "-"

# A handler of the gateway: its refusals are rendered in the route's dialect when sent (app.py).
Handler = Callable[[Request], Awaitable[Answer]]


def authenticate(ctx: RouterContext, request: Request) -> RouterError | None:
    """The 401 answer for a request that needs a key and has no valid one; None when it may go on."""
    if ctx.auth and not ctx.exemptions.exempt(request.path):
        check = ctx.keys.check(request_key(request), ctx.clock())
        if check.record is None:
            return error_response(401, check.problem or "invalid API key")
        request[KEY_RECORD] = check.record
    return None


def guarded(ctx: RouterContext, handler: Handler) -> Handler:
    async def guarded(request: Request) -> Answer:
        refused = authenticate(ctx, request)
        if refused is not None:
            return refused
        return await handler(request)

    return guarded


def request_record(request: Request) -> ApiKeyRecord | None:
    """The key record :func:`authenticate` kept; None when the path needs no key or auth is off."""
    return request.get(KEY_RECORD)
