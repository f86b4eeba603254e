"""OpenAI's Responses API as vLLM 0.32 serves it: ``POST /v1/responses`` (whole, streamed, background),
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.

A stored response (``store``, true by default) lives in this process only, in a bounded LRU: a
``previous_response_id``, a GET or a cancel on another replica is vLLM's 404. vLLM ignores ``store``
unless ``VLLM_ENABLE_RESPONSES_API_STORE=1``; ``responses_store: 0`` is that default.
A stream is typed SSE, ``event: <type>`` then ``data: <json>``, numbered by ``sequence_number``,
ending with ``response.completed`` and no ``[DONE]``. The shapes (request, response object, events) are
:mod:`llmgw_sim.responses_shapes`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from llmgw_sim import errors
from llmgw_sim import openai_api as oai
from llmgw_sim.engine import Engine, sse_response
from llmgw_sim.responses_shapes import (
    BodyOf,
    EventWriter,
    ResponsesRequest,
    output_message,
    output_text,
    read_request,
    response_body,
    response_usage,
)

_JSON = "application/json"


@dataclass
class Stored:
    body: dict[str, Any]
    # The conversation so far, a follow-up's prompt: this request's words and its answer.
    words: tuple[str, ...]
    task: asyncio.Task[Any] | None = None


@dataclass
class ResponseStore:
    """Stored responses, at most ``capacity``: the least recently used goes first."""

    capacity: int
    _items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def get(self, rid: str) -> Stored | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def put(self, rid: str, item: Stored) -> None:
        if self.capacity == 0:
            return
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def _hex16() -> str:
    """vLLM's random id: 64 random bits in 16 hex digits."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def not_found(rid: str) -> web.Response:
    return errors.error(404, f"Response with id '{rid}' not found.", "invalid_request_error", "response_id")


def add(app: web.Application, engine: Engine) -> None:
    if not engine.opts.generates:
        return
    api = ResponsesRoutes(engine)
    app.router.add_post("/v1/responses", api.create)
    app.router.add_get("/v1/responses/{response_id}", api.retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", api.cancel)


class ResponsesRoutes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.store = ResponseStore(engine.opts.responses_store)

    async def create(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.tracked(self._create(request))

    async def _create(self, request: web.Request) -> web.StreamResponse:
        e = self.engine
        try:
            req = read_request(await e.read_json(request))
        except errors.BadRequest as err:
            return errors.bad_request(err)
        refusal = e.refusal(req.model)
        if refusal is not None:
            return refusal
        storing = req.store and self.store.capacity > 0
        if req.background and not storing:
            return errors.error(
                400,
                "This vLLM engine does not support `store=True` and therefore does not support the "
                "background mode. To enable these features, set the environment variable "
                "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                "invalid_request_error",
                "background",
            )
        words = req.words
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                return not_found(req.previous_response_id)
            words = prev.words + words
        cap = req.max_output_tokens
        # A LoRA adapter answers under its name, its answer salted by it (as chat's).
        served = e.served_name(req.model)
        gen = oai.GenRequest(
            served,
            words,
            cap or e.opts.default_max_tokens,
            cap is not None,
            req.stream,
            False,
            salt=e.adapter_of(req.model) or "",
        )
        tokens = oai.completion_tokens(gen)
        rid = f"resp_{_hex16()}"
        limit = cap if cap is not None else max(e.opts.max_model_len - len(words), 1)
        status = "incomplete" if gen.capped else "completed"

        def body(status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
            return response_body(rid, e.now(), served, req, limit, status, output, usage)

        text = "".join(tokens)
        answer_words = words + tuple(text.split())
        mid = f"msg_{_hex16()}"
        final_output = [output_message(mid, [output_text(text, None)] if text else [], "completed")]
        usage = response_usage(len(words), len(tokens))
        if req.stream:
            return await self._stream(request, req, rid, mid, tokens, body, storing, answer_words)
        if req.background:
            queued = body("queued", [], None)
            item = Stored(queued, answer_words)
            self.store.put(rid, item)

            async def run() -> None:
                # vLLM's stored answer stays "queued" until it is done.
                async with e.slot(len(words) + len(tokens)):
                    await e.decode(len(tokens))
                if item.body["status"] != "cancelled":
                    item.body = body(status, final_output, usage)
                e.done(len(words), len(tokens))

            item.task = e.spawn(run(), name=f"sim-{rid}")
            return web.Response(body=json.dumps(queued).encode(), content_type=_JSON)
        async with e.slot(len(words) + len(tokens)):
            await e.decode(len(tokens))
        out = body(status, final_output, usage)
        if storing:
            self.store.put(rid, Stored(out, answer_words))
        resp = web.Response(body=json.dumps(out).encode(), content_type=_JSON)
        return await e.finish(request, resp, len(words), len(tokens))

    async def _stream(
        self,
        request: web.Request,
        req: ResponsesRequest,
        rid: str,
        mid: str,
        tokens: list[str],
        body: BodyOf,
        storing: bool,
        answer_words: tuple[str, ...],
    ) -> web.StreamResponse:
        e = self.engine
        w = EventWriter()
        resp = sse_response()
        await resp.prepare(request)
        initial = body("in_progress", [], None)
        item = Stored(initial, answer_words, asyncio.current_task())
        if storing and req.background:
            self.store.put(rid, item)
        await resp.write(
            (
                w.event("response.created", response=initial)
                + w.event("response.in_progress", response=initial)
            ).encode()
        )
        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        async with e.slot(len(answer_words)):
            async for due in e.timed(len(tokens)):
                out = ""
                if due.start == 0:
                    out += w.event(
                        "response.output_item.added",
                        output_index=0,
                        item=output_message(mid, [], "in_progress"),
                    )
                    out += w.event(
                        "response.content_part.added",
                        **where,
                        part=output_text("", []),
                    )
                for i in due:
                    out += w.event("response.output_text.delta", **where, delta=tokens[i], logprobs=[])
                await resp.write(out.encode())
        text = "".join(tokens)
        part = output_text(text, None)
        prompt = len(answer_words) - len(text.split())
        final = body("incomplete" if req.max_output_tokens is not None else "completed", [], None)
        final["output"] = [output_message(mid, [part] if text else [], "completed")]
        final["usage"] = response_usage(prompt, len(tokens))
        done = w.event("response.output_text.done", **where, text=text, logprobs=[])
        done += w.event("response.content_part.done", **where, part=part)
        done += w.event("response.output_item.done", output_index=0, item=final["output"][0])
        done += w.event("response.completed", response=final)
        if storing:
            item.body, item.task = final, None
            self.store.put(rid, item)
        await resp.write(done.encode())
        await resp.write_eof()
        e.done(prompt, len(tokens))
        return resp

    async def retrieve(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        item = self.store.get(rid)
        if item is None:
            return not_found(rid)
        if request.query.get("stream", "").lower() in ("true", "1"):
            return errors.error(400, f"Unknown response_id: {rid}", "BadRequestError", "response_id")
        return web.Response(body=json.dumps(item.body).encode(), content_type=_JSON)

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        item = self.store.get(rid)
        if item is None:
            return not_found(rid)
        if item.body["status"] not in ("queued", "in_progress"):
            return errors.error(
                400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id"
            )
        item.body["status"] = "cancelled"
        if item.task is not None and item.task is not asyncio.current_task():
            item.task.cancel()
        return web.Response(body=json.dumps(item.body).encode(), content_type=_JSON)
