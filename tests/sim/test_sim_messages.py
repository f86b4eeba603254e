"""The simulated engine's Anthropic Messages API, driven by the official ``anthropic`` client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import anthropic
import pytest

from llmgw_sim.serving import Listening
from tests.sim.sim_testkit import parse_sse, said

MODEL = "sim-msg"
Engine = Callable[..., Awaitable[Listening]]


@pytest.fixture
async def srv(engine: Engine) -> Listening:
    return await engine(model=MODEL, zero=True, default_max_tokens=5)


@pytest.fixture
async def client(srv: Listening) -> AsyncIterator[anthropic.AsyncAnthropic]:
    c = anthropic.AsyncAnthropic(base_url=srv.url, api_key="unused", max_retries=0)
    yield c
    await c.close()


async def test_plain_message_shape_text_and_usage(client: anthropic.AsyncAnthropic) -> None:
    m = await client.messages.create(
        model=MODEL,
        max_tokens=100,
        system="be kind",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
    )
    # vLLM answers a message as a chat completion: its id is the chat completion's.
    assert m.id.startswith("chatcmpl-")
    assert (m.type, m.role, m.model, m.stop_reason) == ("message", "assistant", MODEL, "end_turn")
    assert [b.type for b in m.content] == ["text"]
    block = m.content[0]
    assert isinstance(block, anthropic.types.TextBlock)
    assert block.text == said("be kind hello there", 5)
    assert (m.usage.input_tokens, m.usage.output_tokens) == (4, 5)


async def test_whole_answer_leaves_stop_sequence_out(srv: Listening, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "a b c"}]}
    async with http.post(srv.url + "/v1/messages", json=body) as r:
        assert r.status == 200
        got = await r.json()
    # vLLM dumps it with exclude_none: no stop_sequence, no null vLLM extras.
    assert set(got) == {"id", "type", "role", "content", "model", "stop_reason", "usage"}
    assert got["stop_reason"] == "max_tokens" and got["usage"] == {"input_tokens": 3, "output_tokens": 2}


async def test_stream_events_in_anthropics_order(srv: Listening, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "x y"}]}
    async with http.post(srv.url + "/v1/messages", json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = parse_sse(await r.read())
    names = [e.event for e in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    data = [e.json() for e in events]
    assert [d["type"] for d in data] == names
    assert data[0]["message"]["usage"] == {"input_tokens": 2, "output_tokens": 0}
    assert "".join(d["delta"]["text"] for d in data[2:5]) == said("x y", 3)
    assert data[6]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[6]["usage"] == {"input_tokens": 2, "output_tokens": 3}
    assert all(e.data != "[DONE]" for e in events)


async def test_stream_through_the_sdk(client: anthropic.AsyncAnthropic) -> None:
    async with client.messages.stream(
        model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "p q"}]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == said("p q", 5)
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 5


async def test_count_tokens(client: anthropic.AsyncAnthropic) -> None:
    n = await client.messages.count_tokens(
        model=MODEL, system="sys", messages=[{"role": "user", "content": "one two three"}]
    )
    assert n.input_tokens == 4


async def test_unknown_model_has_anthropics_error_shape(
    srv: Listening, client: anthropic.AsyncAnthropic, http: aiohttp.ClientSession
) -> None:
    with pytest.raises(anthropic.NotFoundError) as ei:
        await client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert ei.value.body == {
        "type": "error",
        "error": {
            "type": "NotFoundError",
            "message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
        },
    }
    body = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    async with http.post(srv.url + "/v1/messages/count_tokens", json=body) as r:
        assert r.status == 404 and (await r.json())["type"] == "error"


async def test_validation_errors_keep_vllms_openai_shape(srv: Listening, http: aiohttp.ClientSession) -> None:
    # vLLM's request validation runs before the Messages route translates errors.
    cases = [
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "body.max_tokens"),
        ({"max_tokens": 5, "messages": []}, "body.model"),
        ({"model": MODEL, "max_tokens": 5}, "body.messages"),
        (
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
            "body.messages.0.role",
        ),
        ({"model": MODEL, "max_tokens": "5", "messages": []}, "body.max_tokens"),
    ]
    for body, param in cases:
        async with http.post(srv.url + "/v1/messages", json=body) as r:
            assert r.status == 400, body
            err = (await r.json())["error"]
        assert (err["type"], err["param"], err["code"]) == ("Bad Request", param, 400)
