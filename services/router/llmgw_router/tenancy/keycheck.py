"""The key check in front of every route: the same check for every path (exemptions included), the
record it found kept on the request for the handlers that ask (``request_record``), and the handler
type the routes share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from llmgw_common.messages import ApiKeyRecord
from llmgw_router.errors import Answer, RouterError, error_response
from llmgw_router.http.request import Request, RequestKey
from llmgw_router.tenancy.auth import Exemptions, request_key
from llmgw_router.tenancy.keys import KeyTable

KEY_RECORD = RequestKey("key", ApiKeyRecord)
# Requests without auth (static mode with auth off) count their usage under this key id.
ANONYMOUS = "-"

# A handler of the gateway: its refusals are rendered in the route's dialect when sent (app.py).
Handler = Callable[[Request], Awaitable[Answer]]


class KeyCheck:
    """Whether a request's key lets it in."""

    __slots__ = ("auth", "clock", "exemptions", "keys")

    def __init__(
        self, keys: KeyTable, auth: bool, exemptions: Exemptions, clock: Callable[[], float]
    ) -> None:
        self.keys, self.auth, self.exemptions, self.clock = keys, auth, exemptions, clock

    def record(self, request: Request) -> ApiKeyRecord | RouterError | None:
        """The key's record (None: the path needs no key, or auth is off), or the 401."""
        if self.auth and not self.exemptions.exempt(request.path):
            check = self.keys.check(request_key(request), self.clock())
            rec = check.record
            if rec is None:
                return error_response(401, check.problem or "invalid API key")
            return rec
        return None

    def authenticate(self, request: Request) -> RouterError | None:
        """The 401 for a request that needs a key and has no valid one, else None, its record kept on
        the request (``request_record``)."""
        rec = self.record(request)
        if isinstance(rec, RouterError):
            return rec
        if rec is not None:
            request[KEY_RECORD] = rec
        return None

    def guarded(self, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Answer:
            refused = self.authenticate(request)
            if refused is not None:
                return refused
            return await handler(request)

        return guarded


def request_record(request: Request) -> ApiKeyRecord | None:
    """The key record :meth:`KeyCheck.authenticate` kept; None when the path needs no key or auth is off."""
    return request.get(KEY_RECORD)
