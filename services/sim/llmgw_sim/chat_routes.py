"""The handlers of chat and text completions (one conversation, or vLLM's batch of them).

Shapes are in :mod:`llmgw_sim.openai_api`; the timing (slot, prefill by the prefix cache, tokens/s)
is the engine's. A batch of conversations is timed as one, without the prefix cache.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmgw_sim import errors
from llmgw_sim import openai_api as oai
from llmgw_sim import openai_bodies as bodies

if TYPE_CHECKING:
    from llmgw_sim.engine import Engine

_JSON = "application/json"


def add(app: web.Application, engine: Engine) -> None:
    if not engine.opts.generates:
        return
    routes = ChatRoutes(engine)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_post("/v1/chat/completions/batch", routes.batch)
    app.router.add_post("/v1/completions", routes.completions)


class ChatRoutes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.tracked(self._generate(request, chat=True))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.tracked(self._generate(request, chat=False))

    async def batch(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.tracked(self._batch(request))

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        e = self.engine
        try:
            body = await e.read_json(request)
            read = oai.read_chat if chat else oai.read_completion
            req = read(body, e.opts.default_max_tokens)
        except errors.BadRequest as err:
            return errors.bad_request(err)
        refusal = e.refusal(req.model)
        if refusal is not None:
            return refusal
        # A LoRA adapter answers under its own name, and its name salts the answer: another adapter,
        # another answer to the same prompt (and the same one on every replica).
        lora = e.adapter_of(req.model)
        req = replace(req, model=e.served_name(req.model), salt=lora or "")
        rid = e.rid("chatcmpl" if chat else "cmpl")
        created = e.now()
        tokens = oai.completion_tokens(req)
        if req.stream:
            return await self._stream(request, body, req, rid, created, tokens, chat, lora)
        async with e.generation(req.prompt_tokens + len(tokens), req.prompt_tokens, body, lora) as gen:
            await gen.decode(len(tokens))
            gen.completed(tokens)
        build = bodies.chat_response if chat else bodies.completion_response
        resp = web.Response(body=json.dumps(build(rid, created, req, tokens)).encode(), content_type=_JSON)
        return await e.finish(request, resp, req.prompt_tokens, len(tokens), gen.ttft_s)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        req: oai.GenRequest,
        rid: str,
        created: int,
        tokens: list[str],
        chat: bool,
        lora: str | None,
    ) -> web.StreamResponse:
        from llmgw_sim.engine import sse_response

        e = self.engine
        w = bodies.ChunkWriter(rid, created, req, chat)
        resp = sse_response()
        # Headers go out at once, as vLLM's do; the first chunk waits for a slot and the first token.
        await resp.prepare(request)
        # The last token's chunk carries the finish, as vLLM's; with no token at all (a continuation
        # already complete) end() sends it alone.
        last = len(tokens) - 1
        async with e.generation(req.prompt_tokens + len(tokens), req.prompt_tokens, body, lora) as gen:
            if not tokens:
                await gen.decode(1)
                await resp.write(w.first().encode())
            async for due in gen.timed(len(tokens)):
                head = w.first() if due.start == 0 else ""
                await resp.write((head + "".join(w.token(tokens[i], i == last) for i in due)).encode())
            gen.completed(tokens)
            await resp.write(w.end(len(tokens)).encode())
        await resp.write_eof()
        e.done(req.prompt_tokens, len(tokens), gen.ttft_s)
        return resp

    async def _batch(self, request: web.Request) -> web.StreamResponse:
        """vLLM's /v1/chat/completions/batch: one choice per conversation, generated side by side."""
        e = self.engine
        try:
            body = await e.read_json(request)
            convs = body.get("messages")
            if convs is None:
                raise errors.missing("messages", body)
            if not isinstance(convs, list) or not convs:
                raise errors.invalid("messages", "too_short", "List should have at least 1 item", convs)
            if body.get("stream"):
                raise errors.BadRequest("Batch chat completions do not support streaming.", "stream")
            reqs = [oai.read_chat({**body, "messages": conv}, e.opts.default_max_tokens) for conv in convs]
        except errors.BadRequest as err:
            return errors.bad_request(err)
        model = oai.model_of(body)
        refusal = e.refusal(model)
        if refusal is not None:
            return refusal
        lora = e.adapter_of(model)
        answers = [oai.completion_tokens(replace(r, salt=lora or "")) for r in reqs]
        prompt = sum(r.prompt_tokens for r in reqs)
        completion = sum(len(a) for a in answers)
        # The conversations run as one batch in one slot: the longest answer sets the time.
        async with e.slot(prompt + completion):
            await e.decode(max(len(a) for a in answers))
        choices: list[dict[str, Any]] = [
            bodies.chat_choice(i, "".join(a), oai.finish_reason(r))
            for i, (r, a) in enumerate(zip(reqs, answers, strict=True))
        ]
        out = bodies.chat_body(e.rid("chatcmpl"), e.now(), e.served_name(model), choices, prompt, completion)
        resp = web.Response(body=json.dumps(out).encode(), content_type=_JSON)
        return await e.finish(request, resp, prompt, completion)
