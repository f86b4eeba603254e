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
