"""The simulated engine's OpenAI surface, driven by the official ``openai`` client."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from llmgw_sim.serving import Listening
from tests.sim.sim_testkit import prompt_answered_with, said

MODEL = "sim-test"


@pytest.fixture
async def srv(engine: Callable[..., Awaitable[Listening]]) -> Listening:
    return await engine(model=MODEL, zero=True, embedding_dims=32)


@pytest.fixture
async def client(srv: Listening) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def test_models_lists_the_served_model(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


async def test_chat_completion_shape_text_and_usage(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "alpha beta gamma"}]},
        ],
        max_tokens=5,
    )
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL
    assert r.created > 1_600_000_000
    assert r.choices[0].message.role == "assistant"
    # Five tokens of the answer to the messages' words (readable text, not the prompt again).
    assert r.choices[0].message.content == said("be brief alpha beta gamma", 5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)


async def test_chat_without_max_tokens_uses_default_and_stops(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x y"}])
    assert r.usage is not None and r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == said("x y", 16)


async def test_same_prompt_same_answer_and_ids_differ(client: openai.AsyncOpenAI) -> None:
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "one two three"}]
    a = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7)
    b = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.id != b.id


async def test_chat_stream_with_include_usage(client: openai.AsyncOpenAI) -> None:
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "red green blue"}]
    stream = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == said("red green blue", 4)
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == ["length"]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 4)
    assert all(c.usage is None for c in chunks[:-1])
    plain = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert plain.choices[0].message.content == text


async def test_chat_stream_without_usage_ends_with_done(srv: Listening, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "stream": True}
    async with http.post(srv.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert '"usage"' not in raw


async def test_completions_plain_and_streamed(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model=MODEL, prompt="the quick fox", max_tokens=4)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    # A completion continues the prompt's text: its first word comes after a space.
    assert r.choices[0].text == " " + said("the quick fox", 4)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 4)

    stream = await client.completions.create(
        model=MODEL, prompt="the quick fox", max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " " + said("the quick fox", 4)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 7


async def test_completions_prompt_as_token_ids(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5, 6], max_tokens=2)
    assert r.usage is not None and r.usage.prompt_tokens == 6


async def test_embeddings_deterministic_unit_vectors(client: openai.AsyncOpenAI) -> None:
    # The openai client asks for base64 by default and decodes it.
    r = await client.embeddings.create(model=MODEL, input=["hello world", "other text", "hello world"])
    vecs = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2]
    assert all(len(v) == 32 for v in vecs)
    assert vecs[0] == vecs[2]
    assert vecs[0] != vecs[1]
    assert abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-5
    assert r.usage.prompt_tokens == 6
    floats = await client.embeddings.create(
        model=MODEL, input="hello world", encoding_format="float", dimensions=8
    )
    assert len(floats.data[0].embedding) == 8


async def test_embeddings_base64_is_little_endian_float32(
    srv: Listening, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "input": "abc", "encoding_format": "base64"}
    async with http.post(srv.url + "/v1/embeddings", json=body) as r:
        b64 = (await r.json())["data"][0]["embedding"]
    body["encoding_format"] = "float"
    async with http.post(srv.url + "/v1/embeddings", json=body) as r:
        floats = (await r.json())["data"][0]["embedding"]
    decoded = struct.unpack("<32f", base64.b64decode(b64))
    assert decoded == pytest.approx(floats, abs=1e-6)


async def test_unknown_model_is_vllms_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as ei:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 404
    assert ei.value.body == {
        "message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="nope", input="x")


async def test_a_request_without_model_is_served_by_the_engines_model(
    srv: Listening, http: aiohttp.ClientSession
) -> None:
    # vLLM's model field is optional: absent, the served model answers.
    async with http.post(
        srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    ) as r:
        assert r.status == 200
        assert (await r.json())["model"] == MODEL


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
async def test_malformed_json_is_vllms_400(srv: Listening, http: aiohttp.ClientSession, path: str) -> None:
    async with http.post(
        srv.url + path, data=b'{"model": ', headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    # FastAPI's validation handler in vLLM: the position of the error in the body is the param.
    assert (err["type"], err["code"], err["param"]) == ("Bad Request", 400, "body.10")
    assert "json_invalid" in err["message"] and "JSON decode error" in err["message"]
    async with http.post(srv.url + path, json=["not", "an", "object"]) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["param"] == "body" and "valid dictionary" in err["message"]
    async with http.post(srv.url + path, data=b"{}", headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["param"] is None and "Only 'application/json' is allowed" in err["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "type_"),
    [
        ("/v1/chat/completions", {"model": 5, "messages": []}, "body.model", "Bad Request"),
        ("/v1/chat/completions", {"model": MODEL}, "body.messages", "Bad Request"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages", "BadRequestError"),
        ("/v1/chat/completions", {"model": MODEL, "messages": ["x"]}, "body.messages.0.role", "Bad Request"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            "body.messages.0.content",
            "Bad Request",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
            "BadRequestError",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream_options": 1},
            "body.stream_options",
            "Bad Request",
        ),
        ("/v1/completions", {"model": MODEL}, "prompt", "BadRequestError"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_completion_tokens": "3"},
            "body.max_completion_tokens",
            "Bad Request",
        ),
        ("/v1/embeddings", {"model": MODEL, "input": []}, "input", "BadRequestError"),
        ("/v1/embeddings", {"model": MODEL}, "body.input", "Bad Request"),
        ("/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 0}, "dimensions", "BadRequestError"),
        (
            "/v1/embeddings",
            {"model": MODEL, "input": "x", "encoding_format": "int8"},
            "body.encoding_format",
            "Bad Request",
        ),
    ],
)
async def test_invalid_fields_are_400_naming_the_param(
    srv: Listening, http: aiohttp.ClientSession, path: str, body: dict[str, Any], param: str, type_: str
) -> None:
    async with http.post(srv.url + path, json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert (err["param"], err["type"], err["code"]) == (param, type_, 400)


async def test_embeddings_accept_token_id_inputs(srv: Listening, http: aiohttp.ClientSession) -> None:
    for inp, n in (([1, 2, 3], 1), ([[1, 2], [3]], 2)):
        async with http.post(srv.url + "/v1/embeddings", json={"model": MODEL, "input": inp}) as r:
            assert r.status == 200
            assert len((await r.json())["data"]) == n


async def test_unknown_path_and_method_are_starlettes_bare_answers(
    srv: Listening, http: aiohttp.ClientSession
) -> None:
    async with http.get(srv.url + "/v1/nothing") as r:
        assert r.status == 404
        assert await r.json() == {"detail": "Not Found"}
    async with http.get(srv.url + "/v1/chat/completions") as r:
        assert r.status == 405
        assert await r.json() == {"detail": "Method Not Allowed"}
        assert "POST" in r.headers["Allow"]


async def test_stream_events_survive_quotes_and_unicode(client: openai.AsyncOpenAI) -> None:
    # The prompt whose answer is the sentence with quotes, backslashes, accents and an emoji.
    prompt = prompt_answered_with("A note on")
    words = said(prompt, 17)
    assert '"back' in words and "\\" in words and "é" in words and "😀" in words
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=17, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == words
    comp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=17, stream=True)
    assert "".join([c.choices[0].text async for c in comp if c.choices]) == " " + words
