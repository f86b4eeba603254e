"""The simulated engine's /tokenize and /detokenize, speech-to-text, and vLLM's batch of chats."""

from __future__ import annotations

import io
import wave
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from llmgw_sim.serving import Listening
from tests.sim.sim_testkit import parse_sse, said

MODEL = "sim-misc"
Engine = Callable[..., Awaitable[Listening]]


@pytest.fixture
async def srv(engine: Engine) -> Listening:
    return await engine(model=MODEL, zero=True, default_max_tokens=4, max_model_len=2048)


async def post(
    http: aiohttp.ClientSession, srv: Listening, path: str, body: dict[str, Any]
) -> tuple[int, Any]:
    async with http.post(srv.url + path, json=body) as r:
        return r.status, await r.json()


def wav(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return buf.getvalue()


async def test_tokenize_then_detokenize_gives_the_text_back(
    srv: Listening, http: aiohttp.ClientSession
) -> None:
    status, got = await post(
        http, srv, "/tokenize", {"model": MODEL, "prompt": "lorem zebra ipsum", "return_token_strs": True}
    )
    assert status == 200
    assert set(got) == {"count", "max_model_len", "tokens", "token_strs"}
    assert (got["count"], got["max_model_len"], got["token_strs"]) == (3, 2048, ["lorem", "zebra", "ipsum"])
    # The filler words are the ids a prompt of token ids is spoken in.
    assert got["tokens"][0] == 0 and got["tokens"][2] == 1 and got["tokens"][1] >= 5
    status, back = await post(http, srv, "/detokenize", {"model": MODEL, "tokens": got["tokens"]})
    assert (status, back) == (200, {"prompt": "lorem zebra ipsum"})
    status, chat = await post(http, srv, "/tokenize", {"messages": [{"role": "user", "content": "a b"}]})
    assert status == 200 and chat["count"] == 2 and chat["token_strs"] is None


async def test_tokenize_errors(srv: Listening, http: aiohttp.ClientSession) -> None:
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        ("/tokenize", {"model": MODEL}, 400, "body.prompt"),
        ("/tokenize", {"model": MODEL, "prompt": 3}, 400, "body.prompt"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": MODEL}, 400, "body.tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "body.tokens"),
    ]
    for path, body, code, param in cases:
        status, got = await post(http, srv, path, body)
        assert (status, got["error"]["param"], got["error"]["code"]) == (code, param, code), (path, body)


@pytest.fixture
async def client(srv: Listening) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def test_transcription_and_translation_through_the_sdk(client: openai.AsyncOpenAI) -> None:
    t = await client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav(1.2)))
    # 1.2 s at 2.5 words a second: three words (the answer to no prompt); usage is the seconds rounded up.
    assert t.text == said("", 3)
    assert t.usage is not None and t.usage.type == "duration" and t.usage.seconds == 2  # type: ignore[union-attr]
    tr = await client.audio.translations.create(model=MODEL, file=("a.wav", wav(10)))
    assert tr.text == said("", 4)  # capped by default_max_tokens


async def test_transcription_stream_and_errors(srv: Listening, http: aiohttp.ClientSession) -> None:
    form = aiohttp.FormData()
    form.add_field("model", MODEL)
    form.add_field("stream", "true")
    form.add_field("file", wav(0.8), filename="a.wav", content_type="audio/wav")
    async with http.post(srv.url + "/v1/audio/transcriptions", data=form) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = parse_sse(await r.read())
    assert events[-1].data == "[DONE]"
    chunks = [e.json() for e in events[:-1]]
    assert all(c["object"] == "transcription.chunk" and c["id"].startswith("trsc-") for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == said("", 2)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "finish_reason" not in chunks[0]["choices"][0]
    no_file = aiohttp.FormData()
    no_file.add_field("model", MODEL)
    no_file.add_field("x", "y")
    async with http.post(srv.url + "/v1/audio/transcriptions", data=no_file) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "body.file"
    wrong = aiohttp.FormData()
    wrong.add_field("model", "nope")
    wrong.add_field("file", b"x", filename="a.wav")
    async with http.post(srv.url + "/v1/audio/translations", data=wrong) as r:
        assert r.status == 404
    bad_fmt = aiohttp.FormData()
    bad_fmt.add_field("response_format", "srt")
    bad_fmt.add_field("file", b"x", filename="a.wav")
    async with http.post(srv.url + "/v1/audio/transcriptions", data=bad_fmt) as r:
        assert r.status == 400 and "response_format" in (await r.json())["error"]["message"]


async def test_audio_is_served_by_a_transcription_model_only(
    engine: Engine, http: aiohttp.ClientSession
) -> None:
    whisper = await engine(model=MODEL, zero=True, runner="generate", transcription=True)
    form = aiohttp.FormData()
    form.add_field("file", wav(0.4), filename="a.wav")
    async with http.post(whisper.url + "/v1/audio/transcriptions", data=form) as r:
        assert r.status == 200 and (await r.json())["text"] == said("", 1)


async def test_chat_batch_one_choice_per_conversation(srv: Listening, http: aiohttp.ClientSession) -> None:
    body = {
        "model": MODEL,
        "messages": [[{"role": "user", "content": "a b"}], [{"role": "user", "content": "c"}]],
        "max_tokens": 3,
    }
    status, got = await post(http, srv, "/v1/chat/completions/batch", body)
    assert status == 200 and got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-")
    assert [(c["index"], c["message"]["content"]) for c in got["choices"]] == [
        (0, said("a b", 3)),
        (1, said("c", 3)),
    ]
    assert got["usage"]["prompt_tokens"] == 3 and got["usage"]["completion_tokens"] == 6
    for bad, param in (
        ({"model": MODEL}, "body.messages"),
        ({"model": MODEL, "messages": []}, "body.messages"),
        ({**body, "stream": True}, "stream"),
    ):
        status, err = await post(http, srv, "/v1/chat/completions/batch", bad)
        assert status == 400 and err["error"]["param"] == param


async def test_chat_shapes_are_vllms(srv: Listening, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x y"}], "max_tokens": 2}
    status, got = await post(http, srv, "/v1/chat/completions", body)
    assert status == 200
    assert set(got) == {
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
        "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics",
    }  # fmt: skip
    assert set(got["choices"][0]) == {
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "routed_experts",
    }
    async with http.post(
        srv.url + "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        chunks = [e.json() for e in parse_sse(await r.read()) if e.data != "[DONE]"]
    # vLLM: the role chunk, a chunk per token (the last with the finish reason), then usage alone.
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:3]] == [None, "length"]
    assert chunks[2]["choices"][0]["delta"] == {"content": " " + said("x y", 2).split()[1]}
    assert "usage" not in chunks[1] and chunks[3]["choices"] == []
    assert chunks[3]["usage"] == {"prompt_tokens": 2, "total_tokens": 4, "completion_tokens": 2}
    # vLLM's fingerprint rides on the last message only: the usage chunk, else the finishing one.
    assert got["system_fingerprint"].startswith("llmgw-sim-")
    assert chunks[3]["system_fingerprint"] == got["system_fingerprint"]
    assert "system_fingerprint" not in chunks[2]
    async with http.post(srv.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        plain = [e.json() for e in parse_sse(await r.read()) if e.data != "[DONE]"]
    assert plain[-1]["system_fingerprint"] == got["system_fingerprint"]
    assert plain[-1]["choices"][0]["finish_reason"] == "length"
