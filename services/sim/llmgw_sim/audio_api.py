"""vLLM's speech-to-text endpoints: ``/v1/audio/transcriptions`` and ``/v1/audio/translations``.

A multipart form with a ``file`` and an optional ``model`` (the field llmgw's router routes by). The
simulator does not hear: the "speech" is filler words, as many as the audio's seconds allow (2.5 a
second, at most ``default_max_tokens``), and a WAV file's length is read from its header (any other
file counts as 16 kHz 16-bit mono). A transcription's usage is the audio's seconds, rounded up; a
translation has none, as in vLLM. ``stream=true`` is ``data:`` chunks ending in ``[DONE]``.
"""

from __future__ import annotations

import io
import json
import math
import wave
from typing import Any

import aiohttp
from aiohttp import web

from llmgw_sim import errors
from llmgw_sim import openai_api as oai
from llmgw_sim.engine import Engine, sse_response

_JSON = "application/json"
_FORMATS = ("text", "json", "verbose_json", "diarized_json")


def audio_seconds(data: bytes) -> float:
    try:
        with wave.open(io.BytesIO(data)) as w:
            frames: int = w.getnframes()
            rate: int = w.getframerate()
            return frames / float(rate or 1)
    except (wave.Error, EOFError):
        return len(data) / 32000.0


def add(app: web.Application, engine: Engine) -> None:
    if not engine.opts.transcribes:
        return
    api = AudioRoutes(engine)
    app.router.add_post("/v1/audio/transcriptions", api.transcriptions)
    app.router.add_post("/v1/audio/translations", api.translations)


def _form_missing(field: str) -> errors.BadRequest:
    entry = {"type": "missing", "loc": ("body", field), "msg": "Field required", "input": None}
    return errors.BadRequest(f"1 validation error:\n  {entry}", f"body.{field}", validation=True)


class AudioRoutes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.tracked(self._run(request, "transcription"))

    async def translations(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.tracked(self._run(request, "translation"))

    async def _form(self, request: web.Request) -> tuple[dict[str, str], bytes]:
        if not request.content_type.startswith("multipart/form-data"):
            # FastAPI finds no form fields in such a body.
            raise _form_missing("file")
        fields: dict[str, str] = {}
        data: bytes | None = None
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, aiohttp.BodyPartReader) or part.name is None:
                continue
            if part.name == "file":
                data = await part.read()
            else:
                fields[part.name] = await part.text()
        if data is None:
            raise _form_missing("file")
        return fields, data

    async def _run(self, request: web.Request, task: str) -> web.StreamResponse:
        e = self.engine
        try:
            fields, data = await self._form(request)
        except errors.BadRequest as err:
            return errors.bad_request(err)
        refusal = e.refusal(fields.get("model", ""))
        if refusal is not None:
            return refusal
        fmt = fields.get("response_format", "json")
        if fmt not in _FORMATS:
            return errors.error(
                400,
                "Currently only support response_format: `text`, `json`, `verbose_json` or `diarized_json`",
                "BadRequestError",
            )
        if fmt in ("verbose_json", "diarized_json"):
            return errors.error(400, f"Currently do not support {fmt} for {e.opts.model}", "BadRequestError")
        seconds = audio_seconds(data)
        count = max(1, min(e.opts.default_max_tokens, math.ceil(seconds * 2.5)))
        words = tuple(fields.get("prompt", "").split())
        tokens = oai.completion_tokens(oai.GenRequest(e.opts.model, words, count, True, False, False))
        # The audio is the prompt: a second of it is about 50 encoder tokens.
        prompt = max(1, math.ceil(seconds * 50))
        if fields.get("stream", "").lower() in ("true", "1"):
            return await self._stream(request, task, tokens, prompt)
        async with e.slot(prompt + len(tokens)):
            await e.decode(len(tokens))
        body: dict[str, Any] = {"text": "".join(tokens).strip()}
        if task == "transcription":
            body["usage"] = {"type": "duration", "seconds": math.ceil(seconds)}
        resp = web.Response(body=json.dumps(body).encode(), content_type=_JSON)
        return await e.finish(request, resp, prompt, len(tokens))

    async def _stream(
        self, request: web.Request, task: str, tokens: list[str], prompt: int
    ) -> web.StreamResponse:
        e = self.engine
        prefix = "trsc" if task == "transcription" else "trsl"
        head = {"id": e.rid(prefix), "object": f"{task}.chunk", "created": e.now(), "model": e.opts.model}
        resp = sse_response()
        await resp.prepare(request)
        last = len(tokens) - 1
        async with e.slot(prompt + len(tokens)):
            async for due in e.timed(len(tokens)):
                out = ""
                for i in due:
                    choice: dict[str, Any] = {"delta": {"content": tokens[i]}}
                    if i == last:
                        choice.update(finish_reason="length", stop_reason=None)
                    out += f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                await resp.write(out.encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        e.done(prompt, len(tokens))
        return resp
