"""End to end on the router's side: a real agent running two simulated engines that publish vLLM's KV
events, the router's cache service following that agent on a real nats-server.

The blocks the router predicts for a request (the tokenizer the agent put in the object store, the block
size the agent relayed) are the blocks the engine then reports storing; the next turn of that
conversation is chosen for the replica that served the first, whatever the draw; a restarted router
has it again from the agent's snapshot.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS

from llmgw_agent.service import serve
from llmgw_agent.settings import AgentSettings
from llmgw_common.catalog import ModelProfile
from llmgw_common.codec import encode
from llmgw_common.messages import Assignment, ShardAssignment, ShardState
from llmgw_common.subjects import Subjects
from llmgw_router.cache.service import CacheService
from llmgw_runtime.bus import ensure_kv
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import fake_collect, free_port, shard_of, watch_node
from tests.kit.poll import eventually
from tests.router.cache.cache_helpers import Ep

pytestmark = pytest.mark.e2e
BS = 4
PROFILE = ModelProfile(name="ms", engine="sim")


def turn(*contents: str) -> dict[str, object]:
    roles = ["user", "assistant"]
    msgs = [{"role": "system", "content": " ".join(f"rule{i}" for i in range(30))}]
    msgs += [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return {"model": "ms", "messages": msgs, "max_tokens": 2}


async def cache_service(nc: NATS, prefix: str) -> CacheService:
    svc = CacheService(nc, Subjects(prefix), lambda: ["n1"], lambda: ["ms"])
    await svc.start()
    svc.routing_changed([PROFILE], ["ra", "rb"])
    await eventually(svc.follower.ready.is_set, timeout=10, what="the first snapshot")
    await eventually(
        lambda: svc.tokenizers.get("ms") is not None, timeout=20, what="the agent's tokenizer loaded"
    )
    return svc


async def test_the_router_predicts_the_blocks_the_engine_stores_and_routes_the_next_turn_there(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
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
    seen = await watch_node(nc, prefix, node)
    assign = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_assign)
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(settings, stop, collect=fake_collect))
    ports = {"ra": free_port(), "rb": free_port()}
    services: list[CacheService] = []
    try:
        shards = tuple(
            ShardAssignment(
                replica_id=r,
                shard=0,
                model="ms",
                engine="sim",
                port=p,
                options={"ttft_ms": 1, "block_size": BS},
            )
            for r, p in ports.items()
        )
        await assign.put(node, encode(Assignment(node=node, fence=1, shards=shards)))

        def both_ready(h: Any) -> bool:
            return all((x := shard_of(h, r)) is not None and x.state is ShardState.READY for r in ports)

        await seen.wait("heartbeat", both_ready)
        svc = await cache_service(nc, prefix)
        services.append(svc)
        first = turn(" ".join(f"w{i}" for i in range(40)))
        eps = [Ep("ra"), Ep("rb")]
        async with httpx.AsyncClient(timeout=10) as http:
            # The relay's SUB joins the engine's PUB asynchronously: the first request is repeated until
            # its blocks show (the engine stores them once; the repeats are hits).
            async def predicted_blocks_held() -> bool:
                if svc.index.block_size("ms") is not None:
                    p = svc.routing.prefix("ms", first, None)
                    if p is not None and set(p.keys) <= svc.index.keys_of("ra"):
                        return True
                r = await http.post(f"http://127.0.0.1:{ports['ra']}/v1/chat/completions", json=first)
                r.raise_for_status()
                await asyncio.sleep(0.3)
                return False

            await eventually(
                predicted_blocks_held, timeout=30, what="ra's blocks as the router predicts them"
            )
        assert svc.index.block_size("ms") == BS
        assert svc.index.keys_of("rb") == frozenset()
        # The next turn re-sends the conversation with the answer and a new question: ra holds its prefix.
        second = turn(" ".join(f"w{i}" for i in range(40)), "an answer", "and a follow-up question")
        p2 = svc.routing.prefix("ms", second, None)
        assert p2 is not None and svc.index.match("ms", p2.keys).get("ra", 0) >= 10
        for seed in range(10):
            assert svc.routing.choose("ms", eps, p2, 0.0, random.Random(seed)) is eps[0]
        # A router that restarts has the same index from the agent's snapshot, at once.
        await svc.stop()
        again = await cache_service(nc, prefix)
        services.append(again)
        p2 = again.routing.prefix("ms", second, None)
        assert p2 is not None and again.routing.choose("ms", eps, p2, 0.0, random.Random(0)) is eps[0]
        # The replica is unassigned: the agent says it is gone, and the index forgets it.
        await assign.put(node, encode(Assignment(node=node, fence=1, shards=shards[1:])))
        await eventually(lambda: "ra" not in again.index.replicas(), timeout=20, what="ra dropped")
    finally:
        for s in services:
            await s.stop()
        stop.set()
        await asyncio.wait_for(agent, 30)
