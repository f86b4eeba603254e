"""The official ``openai`` (Responses API) and ``anthropic`` (Messages) SDKs through a router in front
of two simulated replicas: what Claude Code and Responses clients send, answered whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import openai
import pytest

from llmgw_common.messages import Endpoint
from llmgw_router.dialects.stored import untag
from llmgw_router.routing.endpoints import EndpointState
from llmgw_router.service import Router
from llmgw_runtime.apikeys import generate_key, hash_key
from tests.router.router_helpers import EngineFactory, RouterFactory, StaticFile

KEY = generate_key()
Setup = tuple[Router, str]


@pytest.fixture
async def setup(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> AsyncIterator[Setup]:
    a = await engines("gen")
    b = await engines("gen")
    r = await routers(static_file({"gen": [a.url, b.url]}, keys=[{"name": "k", "hash": hash_key(KEY)}]))
    yield r, f"http://127.0.0.1:{r.port}"


def _replica(r: Router, response_id: str) -> str:
    found = untag(response_id)
    assert found is not None, f"{response_id} carries no replica"
    return r.ctx.pool.by_tag[found[0]].replica_id


@pytest.mark.slow
async def test_responses_follow_their_stored_replica(setup: Setup) -> None:
    r, base = setup
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    first = await client.responses.create(model="gen", input="hello", max_output_tokens=8)
    assert first.output_text and first.usage is not None and first.usage.output_tokens > 0
    home = _replica(r, first.id)
    # Every later turn names the first: each lands on the replica holding it (with P2C over two
    # replicas, eight turns would miss it about half the time).
    prev = first.id
    for i in range(8):
        nxt = await client.responses.create(
            model="gen", input=f"turn {i}", previous_response_id=prev, max_output_tokens=4
        )
        assert _replica(r, nxt.id) == home and nxt.previous_response_id == prev
        prev = nxt.id
    again = await client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    # Streamed: typed events relayed whole, the ids in them tagged like a whole answer's.
    stream = await client.responses.create(
        model="gen", input="stream", previous_response_id=prev, max_output_tokens=6, stream=True
    )
    kinds, done_id = [], ""
    async for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.completed":
            done_id = ev.response.id
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds and _replica(r, done_id) == home
    # Usage of all ten answers counted under the key, from input/output tokens.
    row = r.ctx.usage.usage["static-0"]["gen"]
    assert row[0] == 11 and row[1] > 0 and row[2] > 0
    await client.close()


@pytest.mark.slow
async def test_a_response_whose_replica_left_is_a_clear_404(setup: Setup) -> None:
    r, base = setup
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    first = await client.responses.create(model="gen", input="hello", max_output_tokens=4)
    home = _replica(r, first.id)
    # The router's routing now lists only the other replica.
    keep = [e for e in r.ctx.pool.by_model["gen"] if e.replica_id != home]
    r.ctx.pool._apply([[_endpoint(e)] for e in keep], {})
    with pytest.raises(openai.NotFoundError) as e:
        await client.responses.retrieve(first.id)
    assert "no longer serves" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="gen", input="x", previous_response_id=first.id)
    await client.close()


def _endpoint(e: EndpointState) -> Endpoint:
    return Endpoint(model=e.model, replica_id=e.replica_id, url=e.url, node=e.node)


async def test_anthropic_messages_plain_and_streamed(setup: Setup) -> None:
    r, base = setup
    client = anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0)
    msg = await client.messages.create(
        model="gen", max_tokens=6, messages=[{"role": "user", "content": "hello"}]
    )
    assert msg.type == "message" and msg.content and msg.usage.output_tokens == 6
    async with client.messages.stream(
        model="gen", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text and final.usage.output_tokens == 5 and final.stop_reason == "max_tokens"
    # Bearer works as well as x-api-key.
    bearer = anthropic.AsyncAnthropic(base_url=base, auth_token=KEY, max_retries=0)
    assert (
        await bearer.messages.create(model="gen", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    ).content
    with pytest.raises(anthropic.NotFoundError) as e:
        await client.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "not_found_error"
    row = r.ctx.usage.usage["static-0"]["gen"]
    assert row[0] == 3 and row[2] == 6 + 5 + 2
    await client.close()
    await bearer.close()


async def test_a_response_is_found_from_another_router_and_after_a_restart(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    a = await engines("gen")
    b = await engines("gen")
    static = static_file({"gen": [a.url, b.url]}, auth=False)
    r1 = await routers(static)
    made = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{r1.port}/v1", api_key="-", max_retries=0)
    first = await made.responses.create(model="gen", input="hello", max_output_tokens=4)
    await r1.stop()
    # A router that never saw the response (a restart is one) reads the replica from the id alone.
    r2 = await routers(static)
    other = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{r2.port}/v1", api_key="-", max_retries=0)
    for _ in range(6):
        got = await other.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == first.output_text
    await made.close()
    await other.close()


async def test_audio_transcription_is_routed_by_its_form_field(setup: Setup) -> None:
    r, base = setup
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    wav = b"RIFF" + b"\x00" * 2000
    got = await client.audio.transcriptions.create(model="gen", file=("a.wav", wav, "audio/wav"))
    assert got.text
    with pytest.raises(openai.NotFoundError):
        await client.audio.transcriptions.create(model="nope", file=("a.wav", wav, "audio/wav"))
    assert r.ctx.usage.usage["static-0"]["gen"][0] == 1
    await client.close()
