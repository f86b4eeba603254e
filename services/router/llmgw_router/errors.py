"""OpenAI-shaped error answers: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from llmgw_router import web

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


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    etype, default_code = _KINDS.get(status, ("api_error", None))
    return json.dumps(
        {"error": {"message": message, "type": etype, "param": param, "code": code or default_code}}
    ).encode()


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after: int | None = None,
) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.Response(
        status=status,
        body=error_body(status, message, param=param, code=code),
        content_type="application/json",
        headers=headers,
    )
