"""LoRA adapters end to end on the router's side (issue 33): a real agent runs two simulated engines
with LoRA on, converges their adapters to its assignment and reports them; a real router follows that
agent and the routing table the test writes as a control plane would.

The router sends an adapter's requests only where the agent reports it loaded, and the blocks it
predicts for an adapter's prompt (its base's tokenizer and index, salted by the adapter's name) are the
blocks the engine reports storing for it, distinct from the base's own."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client as NATS

from llmgw_agent.service import serve
from llmgw_agent.settings import AgentSettings
from llmgw_common.catalog import AdapterProfile, Catalog, ModelProfile
from llmgw_common.codec import encode
from llmgw_common.kvcache import request_salt
from llmgw_common.messages import (
    AdapterLoad,
    Assignment,
    Endpoint,
    RoutingCatalog,
    RoutingEndpoints,
    ShardAssignment,
    ShardState,
)
from llmgw_common.subjects import Subjects
from llmgw_router.service import Router
from llmgw_runtime.bus import ensure_kv
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import fake_collect, free_port, shard_of, watch_node
from tests.kit.poll import eventually
from tests.router.router_helpers import RouterFactory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BS = 4
BASE = ModelProfile(name="ms", engine="sim", max_loras=2)
CATALOG = Catalog(
    models=(BASE,), adapters=(AdapterProfile(name="a1", base="ms", weights="/models/loras/a1"),)
)


def turn(model: str, *contents: str) -> dict[str, Any]:
    roles = ["user", "assistant"]
    msgs = [{"role": "system", "content": " ".join(f"rule{i}" for i in range(30))}]
    msgs += [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return {"model": model, "messages": msgs, "max_tokens": 2}


async def _post(port: int, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
            return resp.status, json.loads(await resp.read())


async def test_an_adapter_goes_where_the_agent_reports_it_and_its_blocks_are_salted_by_its_name(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path, routers: RouterFactory
) -> None:
    node = "n1"
    settings = AgentSettings(
        node=node,
        nats_urls=[nats_server.url],
        prefix=prefix,
        state_dir=str(tmp_path / "agent"),
        simulate_engines=True,
        heartbeat_interval_s=0.3,
        load_interval_s=0.2,
        stop_grace_s=2.0,
    )
    subjects = Subjects(prefix)
    seen = await watch_node(nc, prefix, node)
    assign = await ensure_kv(nc.jetstream(), subjects.bucket_assign)
    routing = await ensure_kv(nc.jetstream(), subjects.bucket_routing)
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(settings, stop, collect=fake_collect))
    ports = {"ra": free_port(), "rb": free_port()}
    a1 = (AdapterLoad(name="a1", weights="/models/loras/a1"),)

    def shards(adapters: dict[str, tuple[AdapterLoad, ...]]) -> tuple[ShardAssignment, ...]:
        return tuple(
            ShardAssignment(
                replica_id=r,
                shard=0,
                model="ms",
                engine="sim",
                port=p,
                options={"ttft_ms": 1, "block_size": BS},
                max_loras=2,
                adapters=adapters.get(r, ()),
            )
            for r, p in ports.items()
        )

    try:
        await assign.put(node, encode(Assignment(node=node, fence=1, shards=shards({"ra": a1}))))

        def both_ready(h: Any) -> bool:
            return all((x := shard_of(h, r)) is not None and x.state is ShardState.READY for r in ports)

        await seen.wait("heartbeat", both_ready)
        await routing.put("catalog", encode(RoutingCatalog(version=1, catalog=CATALOG)))
        eps = tuple(
            Endpoint(replica_id=r, model="ms", url=f"http://127.0.0.1:{p}", node=node)
            for r, p in ports.items()
        )
        await routing.put("endpoints", encode(RoutingEndpoints(version=1, endpoints={"ms": eps})))
        r: Router = await routers(nats_urls=[nats_server.url], prefix=prefix, auth=False, router_id="rx")
        await asyncio.wait_for(r.synced.wait(), 10)
        pool = r.ctx.pool
        await eventually(
            lambda: [e.replica_id for e in pool.holders("a1")] == ["ra"], timeout=30, what="a1 reported on ra"
        )
        cache = r.ctx.cache
        assert cache is not None
        await eventually(lambda: cache.tokenizers.get("ms") is not None, timeout=30, what="ms's tokenizer")
        first = turn("a1", " ".join(f"w{i}" for i in range(40)))

        async def predicted_blocks_held() -> bool:
            # The relay's SUB joins the engine's PUB asynchronously: sent again until its blocks show.
            p = cache.prefix("ms", first, request_salt("a1", None))
            if p is not None and set(p.keys) <= cache.index.keys_of("ra"):
                return True
            status, _ = await _post(r.port, first)
            assert status == 200
            await asyncio.sleep(0.3)
            return False

        await eventually(
            predicted_blocks_held, timeout=30, what="ra's blocks for a1 as the router predicts them"
        )
        # Only ra was asked: rb has no block at all. The base's own blocks for the same prompt are others.
        assert cache.index.keys_of("rb") == frozenset()
        plain = cache.prefix("ms", {**first, "model": "ms"}, None)
        assert plain is not None and not set(plain.keys) & cache.index.keys_of("ra")
        # a1 loaded on rb too: the conversation's next turn stays where its prefix is cached.
        await assign.put(node, encode(Assignment(node=node, fence=1, shards=shards({"ra": a1, "rb": a1}))))
        await eventually(lambda: len(pool.holders("a1")) == 2, timeout=30, what="a1 reported on rb too")
        second = turn("a1", " ".join(f"w{i}" for i in range(40)), "an answer", "and a follow-up question")
        p2 = cache.prefix("ms", second, request_salt("a1", None))
        assert p2 is not None and cache.index.match("ms", p2.keys).get("ra", 0) >= 10
        holders = pool.holders("a1")
        for seed in range(10):
            chosen = cache.choose("ms", holders, p2, 0.0, random.Random(seed))
            assert chosen is not None and chosen.replica_id == "ra"
        # Unloaded from ra (the assignment no longer lists it): the router stops sending it there.
        await assign.put(node, encode(Assignment(node=node, fence=1, shards=shards({"rb": a1}))))
        await eventually(
            lambda: [e.replica_id for e in pool.holders("a1")] == ["rb"], timeout=30, what="a1 on rb only"
        )
        status, body = await _post(r.port, second)
        assert status == 200 and body["model"] == "a1"
    finally:
        stop.set()
        await asyncio.wait_for(agent, 30)
