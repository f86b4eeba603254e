"""Routing by cached prefix on real vLLM (issue 32): the session cluster's two gemma replicas publish their
KV-cache events (the agent's adapter turns them on), the agents relay them, the router reads gemma's own
tokenizer from the object store and predicts each request's blocks; a conversation's second turn reaches
the replica that holds its first, because the events said so.

Shown with the engines' own counters (``vllm:prefix_cache_hits_total``): the engine that served the second
turn found the whole first prompt cached, and the router had predicted those hits. Which replica serves
the first turn is the load's choice (random between idle replicas), so the replica order differs run to
run. Runs before ``test_vllm_cluster`` (name order) on the default catalog, so it costs no vLLM start.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from llmgw_agent.metrics import PREFIX_HITS, PREFIX_QUERIES, parse_prometheus
from tests.http_clients import async_client
from tests.kit.poll import eventually
from tests.vllm.vllm_cluster import VllmCluster, endpoints

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1500)]

BLOCK = 128  # vLLM's block size on CPU
WORDS = (
    "river stone garden window silver morning quiet engine harbor lantern meadow copper signal "
    "orchard valley thunder candle bridge winter forest anchor mirror pepper violet marble"
).split()


async def _metrics(url: str) -> dict[str, float]:
    async with async_client(timeout=10) as h:
        r = await h.get(url)
        r.raise_for_status()
        return parse_prometheus(r.text)


async def _counters(urls: list[str]) -> dict[str, tuple[float, float]]:
    out = {}
    for u in urls:
        m = await _metrics(f"{u}/metrics")
        out[u] = (m.get(PREFIX_QUERIES, 0.0), m.get(PREFIX_HITS, 0.0))
    return out


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def test_a_second_turn_reaches_the_replica_holding_the_first_because_the_events_said_so(
    cluster: tuple[VllmCluster, str],
) -> None:
    c, key = cluster
    table = await endpoints(c, "gemma", 2)
    engines = [e.url for e in table.endpoints["gemma"]]
    router = c.procs["router"]
    metrics_url = f"http://127.0.0.1:{router.admin_port}/metrics"

    async def tokenizer_loaded() -> bool:
        return (await _metrics(metrics_url)).get("llmgw_router_tokenizer_loads_total", 0.0) >= 1

    # The agent puts gemma's tokenizer in the object store once a replica serves; the router reads it.
    await eventually(tokenizer_loaded, timeout=60, every=0.5, what="gemma's tokenizer loaded by the router")
    rng = random.Random()
    # Three conversations: each first turn lands where the load says (between idle replicas, either), so
    # by load alone all three second turns would find their replica one time in eight.
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=180) as http:
        for _ in range(3):
            await _conversation(http, c, engines, metrics_url, rng)


async def _conversation(
    http: httpx.AsyncClient, c: VllmCluster, engines: list[str], metrics_url: str, rng: random.Random
) -> None:
    # About 380 tokens of shared context (the cluster's gemma takes 512): two full 128-token blocks and
    # more, a prefill of seconds on one core.
    msgs: list[dict[str, str]] = [
        {"role": "system", "content": _text(rng, 350)},
        {"role": "user", "content": "Name one word from the list above."},
    ]

    async def chat() -> str:
        body = {"model": "gemma", "messages": msgs, "max_tokens": 2, "temperature": 0}
        r = await http.post(f"{c.router_url()}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"] or "")

    before = await _counters(engines)
    answer = await chat()
    first = await _counters(engines)
    served = [u for u in engines if first[u][0] > before[u][0]]
    assert len(served) == 1, (before, first)
    # The second turn: the first's prompt and answer, and a new question. The pause lets the events
    # reach the router and a load report show the first replica idle again.
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And another one."}]
    await asyncio.sleep(2.0)
    predicted = (await _metrics(metrics_url)).get("llmgw_router_prefix_predicted_hit_tokens_total", 0.0)
    await chat()
    second = await _counters(engines)
    again = [u for u in engines if second[u][0] > first[u][0]]
    assert again == served, f"the second turn went to {again}, its prefix is on {served}"
    hits = second[served[0]][1] - first[served[0]][1]
    # The first prompt's full blocks (vLLM recomputes at least the last token) were found cached.
    assert hits >= 2 * BLOCK, (hits, first, second)
    # And the router expected them: its prediction, from the engine's events and its own tokenizing.
    predicted_after = (await _metrics(metrics_url)).get("llmgw_router_prefix_predicted_hit_tokens_total", 0.0)
    assert predicted_after - predicted >= 2 * BLOCK, (predicted, predicted_after)
