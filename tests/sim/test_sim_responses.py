"""The simulated engine's Responses API: whole, streamed, stored, continued, background and cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from llmgw_sim.responses_api import ResponseStore, Stored
from llmgw_sim.serving import Listening
from tests.kit.poll import eventually
from tests.sim.sim_testkit import parse_sse, said

MODEL = "sim-resp"
Engine = Callable[..., Awaitable[Listening]]


@pytest.fixture
async def srv(engine: Engine) -> Listening:
    return await engine(model=MODEL, zero=True, default_max_tokens=6)


@pytest.fixture
async def client(srv: Listening) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def test_plain_response_shape_text_and_usage(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="alpha beta gamma", instructions="be brief")
    assert r.id.startswith("resp_") and len(r.id) == 5 + 16
    assert int(r.id[5:], 16) >= 0  # hex, as vLLM's
    assert (r.object, r.model, r.status) == ("response", MODEL, "completed")
    assert r.instructions == "be brief"
    (msg,) = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.status == "completed"
    # The prompt is the instructions and the input.
    assert r.output_text == said("be brief alpha beta gamma", 6)
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (5, 6, 11)
    assert r.incomplete_details is None


async def test_max_output_tokens_makes_it_incomplete(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="one two", max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == said("one two", 3) and r.max_output_tokens == 3


async def test_input_items_and_stored_lookup(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "red green"}]}],
    )
    got = await client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()


async def test_previous_response_id_continues_the_conversation(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(model=MODEL, input="sun moon", max_output_tokens=2)
    assert first.output_text == said("sun moon", 2)
    second = await client.responses.create(
        model=MODEL, input="star", previous_response_id=first.id, max_output_tokens=5
    )
    # The prompt is the whole conversation: the first input, its answer, then the new input.
    assert second.usage is not None and second.usage.input_tokens == 5
    assert second.previous_response_id == first.id
    assert second.output_text == said(f"sun moon {first.output_text} star", 5)


async def test_unknown_ids_are_vllms_404(srv: Listening, client: openai.AsyncOpenAI) -> None:
    expected = {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    for call in (
        client.responses.retrieve("resp_nope"),
        client.responses.cancel("resp_nope"),
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope"),
    ):
        with pytest.raises(openai.NotFoundError) as ei:
            await call
        assert ei.value.body == expected


async def test_another_replica_does_not_hold_the_response(engine: Engine, client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="kept here")
    other = await engine(model=MODEL, zero=True)
    async with openai.AsyncOpenAI(base_url=other.url + "/v1", api_key="x", max_retries=0) as c2:
        with pytest.raises(openai.NotFoundError):
            await c2.responses.retrieve(r.id)


async def test_store_false_is_not_kept(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="gone", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)


async def test_store_disabled_ignores_store_and_refuses_background(engine: Engine) -> None:
    srv = await engine(model=MODEL, zero=True, responses_store=0)
    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
        r = await c.responses.create(model=MODEL, input="a b")
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.create(model=MODEL, input="a b", background=True)
    assert ei.value.body is not None
    assert isinstance(ei.value.body, dict) and ei.value.body["param"] == "background"
    assert "VLLM_ENABLE_RESPONSES_API_STORE" in ei.value.body["message"]


async def test_stream_events_names_order_and_numbers(srv: Listening, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "input": "x y z", "stream": True, "max_output_tokens": 4}
    async with http.post(srv.url + "/v1/responses", json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = parse_sse(await r.read())
    names = [e.event for e in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    data = [e.json() for e in events]
    assert [d["type"] for d in data] == names
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert "".join(d["delta"] for d in data[4:8]) == said("x y z", 4)
    final = data[-1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 4
    assert final["output"][0]["content"][0]["text"] == said("x y z", 4)
    assert all(e.data != "[DONE]" for e in events)


async def test_stream_through_the_sdk_and_stored_after(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model=MODEL, input="p q", stream=True)
    events = [e async for e in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == said("p q", 6)
    rid = events[-1].response.id
    assert (await client.responses.retrieve(rid)).output_text == text


async def test_background_response_runs_then_completes(engine: Engine) -> None:
    srv = await engine(model=MODEL, ttft_ms=50, tokens_per_s=50, default_max_tokens=5)
    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
        r = await c.responses.create(model=MODEL, input="slow words", background=True)
        assert r.status == "queued" and r.output == []

        async def completed() -> bool:
            return (await c.responses.retrieve(r.id)).status == "completed"

        await eventually(completed, timeout=10, what="the background response to complete")
        assert (await c.responses.retrieve(r.id)).output_text == said("slow words", 5)
        # A finished response cannot be cancelled: vLLM's 400.
        with pytest.raises(openai.BadRequestError) as ei:
            await c.responses.cancel(r.id)
        assert isinstance(ei.value.body, dict)
        assert ei.value.body["message"] == "Cannot cancel a synchronous response."


async def test_cancel_stops_a_background_response_and_frees_its_slot(engine: Engine) -> None:
    srv = await engine(model=MODEL, ttft_ms=5000, slots=1)
    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
        r = await c.responses.create(model=MODEL, input="never", background=True)
        await eventually(
            lambda: srv.engine.slots.running == 1, timeout=5, what="the response to take its slot"
        )
        cancelled = await c.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        await eventually(lambda: srv.engine.slots.running == 0, timeout=5, what="the slot to be freed")
        assert (await c.responses.retrieve(r.id)).status == "cancelled"


async def test_bad_bodies_are_vllms_400(srv: Listening, http: aiohttp.ClientSession) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"model": MODEL}, "body.input"),
        ({"model": MODEL, "input": 5}, "body.input"),
        ({"model": MODEL, "input": "x", "max_output_tokens": "many"}, "body.max_output_tokens"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ]
    for body, param in cases:
        async with http.post(srv.url + "/v1/responses", json=body) as r:
            assert r.status == 400, body
            err = (await r.json())["error"]
        assert err["param"] == param and err["code"] == 400


def test_store_is_a_bounded_lru() -> None:
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, Stored({"id": rid}, ()))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", Stored({"id": "c"}, ()))
    assert len(store) == 2 and store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None
    off = ResponseStore(0)
    off.put("a", Stored({}, ()))
    assert off.get("a") is None


async def test_store_keeps_at_most_its_capacity_over_http(engine: Engine) -> None:
    srv = await engine(model=MODEL, zero=True, responses_store=3)
    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
        ids = [(await c.responses.create(model=MODEL, input=f"n{i}")).id for i in range(5)]
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(ids[0])
        assert (await c.responses.retrieve(ids[-1])).id == ids[-1]


async def test_stream_is_cut_when_its_replica_stops(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(model=MODEL, ttft_ms=10, tokens_per_s=20, default_max_tokens=40)
    body = {"model": MODEL, "input": "long", "stream": True}
    async with http.post(srv.url + "/v1/responses", json=body) as r:
        first = await r.content.readline()
        assert first == b"event: response.created\n"
        await srv.runner.cleanup()
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(r.read(), 10)
