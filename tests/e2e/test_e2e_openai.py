"""The official `openai` client against the router of a real `llmgw up`."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.e2e_cluster import Cluster, wait_model

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e")]

GPU_MODEL = "llama-3.1-8b"  # two replicas on the simulated H100 nodes
CPU_MODEL = "tiny-cpu"


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key=cluster.key, max_retries=0, timeout=30)


def test_up_served_within_a_minute(cluster: Cluster) -> None:
    assert cluster.started_s < 60, cluster.diagnostics()
    out = cluster.output()
    assert f"OpenAI base URL  {cluster.base_url}" in out
    assert f"curl {cluster.router_url}/v1/chat/completions" in out
    assert f'Authorization: Bearer {cluster.key}"' in out
    assert f'OpenAI(base_url="{cluster.base_url}", api_key="{cluster.key}")' in out
    assert f"logs             {cluster.logs_dir}/" in out


def test_models_lists_the_catalog(cluster: Cluster, client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {GPU_MODEL, CPU_MODEL, "qwen2.5-coder-7b"} <= ids


@pytest.mark.parametrize("model", [GPU_MODEL, CPU_MODEL])
def test_chat_non_streaming(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    wait_model(cluster, model)
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8
    )
    assert r.model == model
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens > 0


def test_chat_streaming(cluster: Cluster, client: openai.OpenAI) -> None:
    wait_model(cluster, GPU_MODEL)
    stream = client.chat.completions.create(
        model=GPU_MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 2
    assert text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")


def test_completions(cluster: Cluster, client: openai.OpenAI) -> None:
    wait_model(cluster, CPU_MODEL)
    r = client.completions.create(model=CPU_MODEL, prompt="Once upon a time", max_tokens=6)
    assert r.choices[0].text
    stream = client.completions.create(model=CPU_MODEL, prompt="Once", max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)


def test_node_selector_model_serves(cluster: Cluster, client: openai.OpenAI) -> None:
    wait_model(cluster, "qwen2.5-coder-7b")
    r = client.chat.completions.create(model="qwen2.5-coder-7b", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content


def test_unknown_model_is_404_and_bad_key_401(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.base_url, api_key=cluster.key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=cluster.base_url, api_key="llmgw-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=CPU_MODEL, messages=[{"role": "user", "content": "x"}])


def test_responses_api_through_up(cluster: Cluster, client: openai.OpenAI) -> None:
    """The issue's first 404: `client.responses.create` through `llmgw up`, plain, streamed and with
    previous_response_id (the model has two replicas: the follow-up must reach the one storing it)."""
    wait_model(cluster, GPU_MODEL)
    first = client.responses.create(model=GPU_MODEL, input="Say hello", max_output_tokens=8)
    assert first.output_text and first.status in ("completed", "incomplete")
    for _ in range(4):
        nxt = client.responses.create(
            model=GPU_MODEL, input="and again", previous_response_id=first.id, max_output_tokens=4
        )
        assert nxt.previous_response_id == first.id and nxt.output_text
    kinds = [ev.type for ev in client.responses.create(model=GPU_MODEL, input="x", stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert client.responses.retrieve(first.id).id == first.id


def test_anthropic_messages_through_up(cluster: Cluster) -> None:
    anthropic = pytest.importorskip("anthropic")
    wait_model(cluster, GPU_MODEL)
    client = anthropic.Anthropic(base_url=cluster.router_url, api_key=cluster.key, max_retries=0, timeout=30)
    msg = client.messages.create(model=GPU_MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert msg.content and msg.usage.output_tokens > 0
    with client.messages.stream(
        model=GPU_MODEL, max_tokens=6, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
    assert text
