"""The official SDKs through llmgw's router in front of a real vLLM: the openai SDK's Responses API
(plain, streamed, ``previous_response_id``, retrieve) and the anthropic SDK's Messages (plain and
streamed), as the issue's clients send them. The session cluster's router and gemma (two replicas,
vLLM's response store on: a follow-up must reach the replica that stored its predecessor)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from llmgw_router.dialects.stored import untag
from tests.vllm.vllm_cluster import VllmCluster

MODEL = "gemma"

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1200)]


@pytest.fixture
def router(cluster: tuple[VllmCluster, str]) -> tuple[str, str]:
    """The router's address and a key for it."""
    c, key = cluster
    return c.router_url(), key


async def test_openai_responses_through_the_router(router: tuple[str, str]) -> None:
    url, key = router
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    first = await client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8)
    assert first.output_text.strip() and untag(first.id) is not None, first
    nxt = await client.responses.create(
        model=MODEL, input="And another.", previous_response_id=first.id, max_output_tokens=8
    )
    assert nxt.previous_response_id == first.id and nxt.output_text.strip(), nxt
    assert (await client.responses.retrieve(first.id)).output_text == first.output_text
    kinds: list[str] = []
    done_id = ""
    stream = await client.responses.create(
        model=MODEL, input="Count to three.", max_output_tokens=8, stream=True
    )
    async for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.completed":
            done_id = ev.response.id
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds and untag(done_id) is not None
    await client.close()


async def test_anthropic_messages_through_the_router(router: tuple[str, str]) -> None:
    url, key = router
    client = anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, timeout=300)
    msg = await client.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Name a colour."}]
    )
    assert msg.type == "message" and msg.content and msg.usage.output_tokens > 0, msg
    async with client.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Count to three."}]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text.strip() and final.usage.output_tokens > 0, final
    await client.close()
