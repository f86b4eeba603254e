"""Anthropic's Messages API as vLLM 0.32 serves it: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

vLLM runs a message request as a chat completion and converts the answer, so the id is the chat
completion's (``chatcmpl-``) and ``stop_sequence`` is left out of a whole answer (it dumps with
``exclude_none``). A stream is typed SSE: ``message_start``, ``content_block_start``,
``content_block_delta`` per token, ``content_block_stop``, ``message_delta`` (stop reason, usage),
``message_stop``; no ``ping`` and no ``[DONE]``. A refusal by the serving code has Anthropic's
error shape; a body that fails validation keeps vLLM's OpenAI-shaped 400, as vLLM's does.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from aiohttp import web

from llmgw_sim import errors
from llmgw_sim import openai_api as oai
from llmgw_sim.engine import Engine, sse_response

_JSON = "application/json"


def _block_words(content: Any, where: str) -> list[str]:
    if isinstance(content, str):
        return content.split()
    if not isinstance(content, list):
        raise errors.invalid(where, "string_type", "Input should be a valid string", content)
    words: list[str] = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or "type" not in block:
            raise errors.invalid(f"{where}.{i}.type", "missing", "Field required", block)
        if isinstance(block.get("text"), str):
            words += block["text"].split()
        inner = block.get("content")
        if inner is not None:
            words += _block_words(inner, f"{where}.{i}.content")
    return words


def read_prompt(body: dict[str, Any]) -> tuple[str, list[str]]:
    """The model and the prompt's words (system first) of a messages or count_tokens request."""
    model = body.get("model")
    if model is None:
        raise errors.missing("model", body)
    if not isinstance(model, str):
        raise errors.invalid("model", "string_type", "Input should be a valid string", model)
    messages = body.get("messages")
    if messages is None:
        raise errors.missing("messages", body)
    if not isinstance(messages, list):
        raise errors.invalid("messages", "list_type", "Input should be a valid list", messages)
    words: list[str] = []
    system = body.get("system")
    if system is not None:
        words += _block_words(system, "system")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise errors.invalid(
                f"messages.{i}.role", "literal_error", "Input should be 'user', 'assistant' or 'system'", m
            )
        if "content" not in m:
            raise errors.invalid(f"messages.{i}.content", "missing", "Field required", m)
        words += _block_words(m["content"], f"messages.{i}.content")
    return model, words


def read_request(body: dict[str, Any], default_max_tokens: int) -> oai.GenRequest:
    model, words = read_prompt(body)
    cap = body.get("max_tokens")
    if cap is None:
        raise errors.missing("max_tokens", body)
    if isinstance(cap, bool) or not isinstance(cap, int):
        raise errors.invalid("max_tokens", "int_type", "Input should be a valid integer", cap)
    if cap < 1:
        raise errors.BadRequest(f"max_tokens must be at least 1, got {cap}.", "max_tokens")
    # Anthropic's max_tokens is a ceiling every request gives: the answer is the simulator's usual
    # length, cut (stop_reason max_tokens) only where the ceiling is lower.
    stream = bool(body.get("stream"))
    return oai.GenRequest(
        model, tuple(words), min(cap, default_max_tokens), cap <= default_max_tokens, stream, stream
    )


def stop_reason(req: oai.GenRequest) -> str:
    return "max_tokens" if req.capped else "end_turn"


def message_body(rid: str, model: str, req: oai.GenRequest, tokens: list[str]) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        # An empty answer is one empty text block, as vLLM (and Anthropic) send it.
        "content": [{"type": "text", "text": "".join(tokens)}],
        "model": model,
        "stop_reason": stop_reason(req),
        "usage": {"input_tokens": req.prompt_tokens, "output_tokens": len(tokens)},
    }


def event(type_: str, data: dict[str, Any]) -> str:
    return f"event: {type_}\ndata: {json.dumps({'type': type_, **data})}\n\n"


def add(app: web.Application, engine: Engine) -> None:
    if not engine.opts.generates:
        return
    api = MessagesRoutes(engine)
    app.router.add_post("/v1/messages", api.create)
    app.router.add_post("/v1/messages/count_tokens", api.count_tokens)


class MessagesRoutes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _refusal(self, model: str) -> web.Response | None:
        """The engine's refusal, translated to Anthropic's shape as vLLM translates its own."""
        refusal = self.engine.refusal(model)
        if refusal is None:
            return None
        assert isinstance(refusal.body, bytes)
        err = json.loads(refusal.body)["error"]
        return errors.anthropic_error(refusal.status, err["type"], err["message"])

    async def create(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.tracked(self._create(request))

    async def _create(self, request: web.Request) -> web.StreamResponse:
        e = self.engine
        try:
            req = read_request(await e.read_json(request), e.opts.default_max_tokens)
        except errors.BadRequest as err:
            return errors.bad_request(err)
        refusal = self._refusal(req.model)
        if refusal is not None:
            return refusal
        # A LoRA adapter answers under its name, its answer salted by it (as chat's).
        req = replace(req, model=e.served_name(req.model), salt=e.adapter_of(req.model) or "")
        tokens = oai.completion_tokens(req)
        rid = e.rid("chatcmpl")
        if req.stream:
            return await self._stream(request, req, rid, tokens)
        async with e.slot(req.prompt_tokens + len(tokens)):
            await e.decode(len(tokens))
        out = message_body(rid, req.model, req, tokens)
        resp = web.Response(body=json.dumps(out).encode(), content_type=_JSON)
        return await e.finish(request, resp, req.prompt_tokens, len(tokens))

    async def _stream(
        self, request: web.Request, req: oai.GenRequest, rid: str, tokens: list[str]
    ) -> web.StreamResponse:
        e = self.engine
        resp = sse_response()
        await resp.prepare(request)
        start: dict[str, Any] = {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": req.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": req.prompt_tokens, "output_tokens": 0},
        }
        async with e.slot(req.prompt_tokens + len(tokens)):
            async for due in e.timed(len(tokens)):
                out = ""
                if due.start == 0:
                    out += event("message_start", {"message": start})
                    out += event(
                        "content_block_start", {"content_block": {"type": "text", "text": ""}, "index": 0}
                    )
                for i in due:
                    out += event(
                        "content_block_delta",
                        {"delta": {"type": "text_delta", "text": tokens[i]}, "index": 0},
                    )
                await resp.write(out.encode())
        if not tokens:
            await resp.write(event("message_start", {"message": start}).encode())
        usage = {"input_tokens": req.prompt_tokens, "output_tokens": len(tokens)}
        end = event("content_block_stop", {"index": 0}) if tokens else ""
        end += event(
            "message_delta",
            {"delta": {"stop_reason": stop_reason(req), "stop_sequence": None}, "usage": usage},
        )
        end += event("message_stop", {})
        await resp.write(end.encode())
        await resp.write_eof()
        e.done(req.prompt_tokens, len(tokens))
        return resp

    async def count_tokens(self, request: web.Request) -> web.Response:
        e = self.engine
        try:
            model, words = read_prompt(await e.read_json(request))
        except errors.BadRequest as err:
            return errors.bad_request(err)
        refusal = self._refusal(model)
        if refusal is not None:
            return refusal
        n = len(words)
        body = {"input_tokens": n, "context_management": {"original_input_tokens": n}}
        return web.Response(body=json.dumps(body).encode(), content_type=_JSON)
