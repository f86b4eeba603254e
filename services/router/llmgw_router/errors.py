"""The router's own error answers, in the shape of the API the client speaks.

OpenAI's ``{"error": {"message", "type", "param", "code"}}`` everywhere, except on Anthropic's paths
(``/v1/messages``), where clients (the ``anthropic`` SDK, Claude Code) read
``{"type": "error", "error": {"type", "message"}}``. Every refusal is made as a :class:`RouterError`
rendered with OpenAI's body, or on an Anthropic path Anthropic's (:meth:`RouterError.response`), so
the many places that refuse (admission, holding, the proxy) need not know who asked. An engine's own
error answer is relayed as the engine sent it, never re-rendered.
"""

from __future__ import annotations

import json

from llmgw_router.http.response import Response, StreamResponse

# The status recorded (metrics, usage, logs) for a request whose client went away before its answer
# was sent: nginx's 499, never sent to anyone.
CLIENT_GONE = 499

# status -> (type, code) as OpenAI's API names them.
_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", "model_not_allowed"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "queue_full"),
    502: ("upstream_error", "upstream_failed"),
    503: ("service_unavailable", "model_unavailable"),
}

# status -> Anthropic's error type (its API's table; 503 is its "overloaded", 5xx else "api_error").
_ANTHROPIC_KINDS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    etype, default_code = _KINDS.get(status, ("api_error", None))
    return json.dumps(
        {"error": {"message": message, "type": etype, "param": param, "code": code or default_code}}
    ).encode()


def anthropic_error_body(status: int, message: str) -> bytes:
    etype = _ANTHROPIC_KINDS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"type": "error", "error": {"type": etype, "message": message}}).encode()


class RouterError:
    """A refusal made by the router (not an engine's answer): a value, what it says kept apart, rendered
    into the server's plain :class:`Response` in the client's dialect only when it is sent."""

    __slots__ = ("close", "code", "headers", "message", "param", "status")

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers: dict[str, str] = headers if headers is not None else {}
        # The connection ends after it (the request's body was not read: a 408).
        self.close = close

    def body(self, anthropic: bool = False) -> bytes:
        if anthropic:
            return anthropic_error_body(self.status, self.message)
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self, anthropic: bool = False) -> Response:
        resp = Response(
            status=self.status,
            body=self.body(anthropic),
            content_type="application/json",
            headers=self.headers or None,
        )
        if self.close:
            resp.force_close()
        return resp


# What a handler of the gateway answers: a response, or a refusal rendered by the route's dialect.
Answer = StreamResponse | RouterError


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after: int | None = None,
) -> RouterError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return RouterError(status, message, param=param, code=code, headers=headers)
