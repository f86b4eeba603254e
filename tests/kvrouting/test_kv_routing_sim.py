"""Routing by cached prefix through a whole cluster of real processes (issue 32): simulated engines with
a prefix cache publish vLLM's KV events, agents relay them, two routers each hold the index, and a
conversation's later turns reach the replica holding its earlier turns, whichever router they reach.

Shown with the engines' own counters (vllm:prefix_cache_hits_total), against what a perfect choice would
find cached, and by which engine answered each turn (the simulator puts its instance in every id). By
load alone, with three replicas, a later turn would find its prefix about one time in three.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw_agent.metrics import PREFIX_HITS, PREFIX_QUERIES, parse_prometheus
from llmgw_common.simtokens import prompt_token_ids
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster
from tests.chaos.chaos_waits import mint_key, routing_table
from tests.http_clients import async_client
from tests.kit.poll import eventually
from tests.kit.ports import free_port

pytestmark = [pytest.mark.xdist_group("kvrouting"), pytest.mark.e2e, pytest.mark.slow]

BLOCK = 16
REPLICAS = 3
CATALOG = f"""\
models:
  - name: chat
    engine: vllm
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: {REPLICAS}
    startup_timeout_s: 30
    options: {{startup_s: 0.2, ttft_ms: 5, tokens_per_s: 400, slots: 16, block_size: {BLOCK},
               prefill_tokens_per_s: 20000}}
"""
ROUTERS = ("router", "router2")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChaosCluster, str, dict[str, int]]]:
    c = ChaosCluster(Path(tmp_path_factory.mktemp("kvrouting")), settings=dict(AGGRESSIVE), catalog=CATALOG)
    admin = {r: free_port() for r in ROUTERS}
    try:
        c.start_nats()
        c.start_controlplane()
        for r in ROUTERS:
            c.start_router(r, admin_port=admin[r])
        for n in ("n1", "n2", "n3"):
            c.start_agent(n)
        key = mint_key(c)
        for r in ROUTERS:
            c.wait_router(r)
        yield c, key, admin
    finally:
        c.close()


async def _metrics(url: str) -> dict[str, float]:
    async with async_client(timeout=5) as h:
        r = await h.get(url)
        r.raise_for_status()
        return parse_prometheus(r.text)


async def _tokenizer_loaded(admin: dict[str, int]) -> bool:
    for port in admin.values():
        m = await _metrics(f"http://127.0.0.1:{port}/metrics")
        if m.get("llmgw_router_tokenizer_loads_total", 0.0) < 1:
            return False
    return True


async def _engine_counters(urls: list[str]) -> tuple[float, float]:
    q = h = 0.0
    for u in urls:
        m = await _metrics(f"{u}/metrics")
        q += m.get(PREFIX_QUERIES, 0.0)
        h += m.get(PREFIX_HITS, 0.0)
    return q, h


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))


async def test_later_turns_reach_the_replica_holding_their_prefix_through_either_router(
    cluster: tuple[ChaosCluster, str, dict[str, int]],
) -> None:
    c, key, admin = cluster
    table = await routing_table(c, "chat", REPLICAS, 60)
    engines = [e.url for e in table.endpoints["chat"]]
    # Each router has read the simulator's tokenizer from the object store (until then it routes by load).
    await eventually(lambda: _tokenizer_loaded(admin), timeout=30, every=0.5, what="the tokenizers loaded")
    rng = random.Random()  # a new order of conversations and replicas each run
    conversations: list[list[dict[str, Any]]] = [
        # Long shared contexts, where the cache is worth more than a request or two of load (score.py:
        # 1,200 uncached tokens weigh as 2.3 requests ahead, a stale report's phantom load as one).
        [{"role": "system", "content": _words(rng, 1200 + rng.randrange(300))}]
        for _ in range(6)
    ]
    served: list[list[str]] = [[] for _ in conversations]
    q0, h0 = await _engine_counters(engines)
    perfect = 0  # prompt tokens a choice that always found the previous turn's replica would hit
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        for turn in range(4):
            order = list(range(len(conversations)))
            rng.shuffle(order)
            for i in order:
                msgs = conversations[i]
                msgs.append({"role": "user", "content": _words(rng, 20 + rng.randrange(30))})
                body = {"model": "chat", "messages": msgs, "max_tokens": 12}
                if turn:
                    ids = prompt_token_ids({"messages": msgs[:-2]}) or []
                    # The previous turn's prompt (its generation prompt included) was stored after its
                    # prefill: every full block of it, bar the engine's last-token rule.
                    perfect += (len(ids) - 1) // BLOCK * BLOCK
                # Turns alternate between the routers: each holds the same index from the same events.
                router = c.router_url(ROUTERS[(i + turn) % 2])
                r = await http.post(f"{router}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                answer = r.json()
                served[i].append(answer["id"].split("-")[1][:8])  # the engine's instance in its ids
                msgs.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            await asyncio.sleep(0.5)  # between turns: the engines' events reach every router
    q1, h1 = await _engine_counters(engines)
    hits = h1 - h0
    # Every later turn on the replica of its first: by load alone, 1 in 3 each (6 x 3 turns).
    wrong = [s for s in served if len(set(s)) != 1]
    assert not wrong, f"conversations whose turns moved between engines: {wrong}"
    assert hits >= perfect > 0, (hits, perfect, q1 - q0)


async def test_a_restarted_router_holds_the_whole_index_again_from_the_agents_snapshots(
    cluster: tuple[ChaosCluster, str, dict[str, int]],
) -> None:
    c, key, admin = cluster
    first, second = (f"http://127.0.0.1:{admin[r]}/metrics" for r in ROUTERS)

    async def blocks(url: str) -> float:
        return (await _metrics(url)).get("llmgw_router_kv_index_blocks", 0.0)

    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        rng = random.Random()
        body = {"model": "chat", "messages": [{"role": "user", "content": _words(rng, 400)}], "max_tokens": 4}
        assert (await http.post(f"{c.router_url()}/v1/chat/completions", json=body)).status_code == 200
    held = await eventually(lambda: blocks(first), timeout=10, what="blocks in the first router's index")
    proc = c.procs[ROUTERS[1]]
    proc.stop()
    c.start_router(ROUTERS[1], port=proc.port, admin_port=admin[ROUTERS[1]])
    await c.wait_router_async(ROUTERS[1])

    async def whole() -> bool:
        return await blocks(second) >= held

    # Nothing was sent meanwhile: the restarted router's index comes from the agents' snapshots alone.
    await eventually(
        whole, timeout=15, every=0.2, what="the restarted router's whole index", tolerate=(httpx.HTTPError,)
    )
