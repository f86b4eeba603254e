"""vLLM's ``/tokenize`` and ``/detokenize``, served by every runner.

The simulator's token is a word. The filler words are ids 0-4, the ones a prompt of token ids is
spoken in; any other word gets an id from a hash of it, remembered (bounded) so that detokenizing
what was tokenized here gives the text back. An id never seen reads as a filler word.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from typing import Any

from aiohttp import web

from llmgw_sim import errors
from llmgw_sim import openai_api as oai
from llmgw_sim.engine import Engine

_JSON = "application/json"
# Ids of other words: above the fillers, within a vocabulary's usual size.
_VOCAB = 262_144
_REMEMBERED = 65_536


class Vocabulary:
    def __init__(self) -> None:
        self._words: OrderedDict[int, str] = OrderedDict()

    def id_of(self, word: str) -> int:
        if word in oai.FILLER:
            return oai.FILLER.index(word)
        tid = len(oai.FILLER) + zlib.crc32(word.encode()) % (_VOCAB - len(oai.FILLER))
        self._words[tid] = word
        self._words.move_to_end(tid)
        if len(self._words) > _REMEMBERED:
            self._words.popitem(last=False)
        return tid

    def word_of(self, tid: int) -> str:
        return self._words.get(tid) or oai.FILLER[tid % len(oai.FILLER)]


def add(app: web.Application, engine: Engine) -> None:
    api = TokensRoutes(engine)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)


class TokensRoutes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.vocab = Vocabulary()

    async def _read(self, request: web.Request) -> dict[str, Any] | web.Response:
        e = self.engine
        try:
            body = await e.read_json(request)
            refusal = e.refusal(oai.model_of(body))
        except errors.BadRequest as err:
            return errors.bad_request(err)
        return refusal or body

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._read(request)
        if isinstance(body, web.Response):
            return body
        try:
            if "messages" in body:
                words = oai.message_words(body["messages"])
            elif isinstance(body.get("prompt"), str):
                words = body["prompt"].split()
            elif "prompt" in body:
                raise errors.invalid(
                    "prompt", "string_type", "Input should be a valid string", body["prompt"]
                )
            else:
                raise errors.missing("prompt", body)
        except errors.BadRequest as err:
            return errors.bad_request(err)
        ids = [self.vocab.id_of(w) for w in words]
        out = {
            "count": len(ids),
            "max_model_len": self.engine.opts.max_model_len,
            "tokens": ids,
            "token_strs": words if body.get("return_token_strs") else None,
        }
        return web.Response(body=json.dumps(out).encode(), content_type=_JSON)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._read(request)
        if isinstance(body, web.Response):
            return body
        tokens = body.get("tokens")
        if tokens is None:
            return errors.bad_request(errors.missing("tokens", body))
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            return errors.bad_request(
                errors.invalid("tokens", "int_type", "Input should be a valid integer", tokens)
            )
        text = " ".join(self.vocab.word_of(t) for t in tokens)
        return web.Response(body=json.dumps({"prompt": text}).encode(), content_type=_JSON)
