"""Error bodies in vLLM 0.32's shapes, so a client (and llmgw's router) sees what a real vLLM sends.

vLLM answers every error as ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP
status as an integer. ``type`` says who refused: FastAPI's request validation (pydantic) gives
``"Bad Request"`` with ``param`` ``"body.<field>"`` and a message listing the validation errors;
a serving class gives ``"BadRequestError"``, ``"NotFoundError"`` and the like. A path vLLM has not
registered (the routes of another runner) is Starlette's bare ``{"detail": "Not Found"}``.
On ``/v1/messages`` a serving error is translated to Anthropic's ``{"type": "error", "error":
{"type", "message"}}``, but a validation error keeps the OpenAI shape: vLLM's validation handler
runs before the route does.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from llmgw_common.errors import InvalidInput

_JSON = "application/json"


class BadRequest(InvalidInput):
    """The request is not something this endpoint accepts; the message names what was wrong.

    ``validation``: refused where vLLM's pydantic models refuse it (a missing field, a wrong type),
    so the answer has the validation handler's type and a ``body.``-prefixed param.
    """

    def __init__(self, message: str, param: str | None = None, *, validation: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.validation = validation

    @property
    def type(self) -> str:
        return "Bad Request" if self.validation else "BadRequestError"


class NotFound(InvalidInput):
    """A thing named by the request (a stored response) is not held here."""

    def __init__(self, message: str, param: str | None = None, type_: str = "NotFoundError") -> None:
        super().__init__(message)
        self.param = param
        self.type = type_


def invalid(field: str, kind: str, msg: str, value: Any = None) -> BadRequest:
    """A pydantic-style validation error of one body field, worded as vLLM's handler words it."""
    entry = {"type": kind, "loc": ("body", field), "msg": msg, "input": _summary(value)}
    return BadRequest(f"1 validation error:\n  {entry}", f"body.{field}", validation=True)


def missing(field: str, body: dict[str, Any]) -> BadRequest:
    return invalid(field, "missing", "Field required", body)


def _summary(value: Any) -> Any:
    # vLLM describes containers instead of echoing them (a large input made huge error bodies).
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value


def error_body(message: str, type_: str, code: int, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def error(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(message, type_, status, param), content_type=_JSON)


def bad_request(e: BadRequest) -> web.Response:
    return error(400, str(e), e.type, e.param)


def not_found(e: NotFound) -> web.Response:
    return error(404, str(e), e.type, e.param)


def detail(status: int, text: str) -> web.Response:
    """Starlette's own answer for a path or method the app has no route for."""
    return web.Response(status=status, body=json.dumps({"detail": text}).encode(), content_type=_JSON)


def anthropic_error(status: int, type_: str, message: str) -> web.Response:
    body = {"type": "error", "error": {"type": type_, "message": message}}
    return web.Response(status=status, body=json.dumps(body).encode(), content_type=_JSON)


def model_not_found(model: str, served: str) -> tuple[int, str, str, str]:
    """vLLM's refusal of a model name it does not serve: status, message, type, param."""
    return 404, f"The model `{model}` does not exist. Valid aliases: {served}.", "NotFoundError", "model"


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, refused as vLLM's validation refuses a bad one."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as e:
        raise invalid(str(e.start), "json_invalid", "JSON decode error", {}) from None
    except json.JSONDecodeError as e:
        entry = {
            "type": "json_invalid",
            "loc": ("body", e.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": e.msg},
        }
        raise BadRequest(f"1 validation error:\n  {entry}", f"body.{e.pos}", validation=True) from None
    if not isinstance(body, dict):
        entry = {
            "type": "model_attributes_type",
            "loc": ("body",),
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": _summary(body),
        }
        raise BadRequest(f"1 validation error:\n  {entry}", "body", validation=True)
    return body


UNSUPPORTED_MEDIA = BadRequest(
    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed", None, validation=True
)


@web.middleware
async def vllm_shapes(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own 404 and 405 (no such route) as Starlette's JSON ``detail``, as vLLM sends them."""
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except web.HTTPNotFound:
        return detail(404, "Not Found")
    except web.HTTPMethodNotAllowed as e:
        resp = detail(405, "Method Not Allowed")
        resp.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
        return resp
