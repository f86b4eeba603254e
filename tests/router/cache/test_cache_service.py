"""Routing by cached prefix, its parts together on a real bus (llmgw_router.cache.service): a stand-in
agent relaying a replica's blocks, the simulator's tokenizer in the object store, a router restarted."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from llmgw_common import simtokens
from llmgw_common.catalog import ModelProfile
from llmgw_common.kvcache import TokenizerKind, block_keys
from llmgw_common.subjects import Subjects
from llmgw_router.cache.service import CacheService
from tests.kit.poll import eventually
from tests.router.cache.cache_helpers import Ep, bundle
from tests.router.cache.kvagent import FakeKvAgent

pytestmark = pytest.mark.slow

BODY = {
    "model": "sim",
    "messages": [
        {"role": "system", "content": "you answer questions about the sea " * 30},
        {"role": "user", "content": "why is it salty"},
    ],
}


@pytest.fixture
async def tokenizer_bucket(nc: NATS, prefix: str) -> AsyncIterator[None]:
    js = nc.jetstream()
    store = await js.create_object_store(Subjects(prefix).bucket_tokenizers)
    await store.put("sim", bundle("sim", TokenizerKind.SIM))
    yield
    await js.delete_object_store(Subjects(prefix).bucket_tokenizers)


async def started(nc: NATS, prefix: str) -> CacheService:
    svc = CacheService(nc, Subjects(prefix), lambda: ["n0"], lambda: ["sim"])
    await svc.start()
    svc.routing_changed([ModelProfile(name="sim", engine="sim")], ["r0", "r1", "r2"])
    await eventually(lambda: svc.tokenizers.get("sim") is not None, what="the sim tokenizer loaded")
    return svc


async def test_a_request_goes_where_the_events_say_its_prefix_is_even_after_a_restart(
    nc: NATS,
    agent_nc: NATS,
    prefix: str,
    tokenizer_bucket: None,
) -> None:
    agent = FakeKvAgent(agent_nc, Subjects(prefix), "n0", block_size=16)
    await agent.serve()
    svc = await started(nc, prefix)
    ids = simtokens.prompt_token_ids(BODY)
    assert ids is not None
    keys = block_keys(ids, 16)
    await agent.publish(agent.change("r1", keys, model="sim"), agent.change("r2", keys[:2], model="sim"))
    await eventually(lambda: svc.index.replica_blocks("r1") == len(keys), what="r1's blocks indexed")
    eps = [Ep("r0"), Ep("r1"), Ep("r2")]
    p = svc.routing.prefix("sim", BODY, None)
    assert p is not None
    for seed in range(10):
        assert svc.routing.choose("sim", eps, p, 0.0, random.Random(seed)) is eps[1]
    svc.routing.sent("sim", "r1", p, 0.0)
    report = svc.report("sim", engine_queries=100.0, engine_hits=40.0)
    assert report is not None
    assert report.mode == "events" and report.prompt_tokens == len(ids)
    assert report.predicted_hit_tokens == len(keys) * 16
    assert report.index_blocks == len(keys) and report.event_lag_ms is not None
    assert report.engine_hits == 40.0 and svc.report("other") is None
    # The router restarts: its new life asks the node for a snapshot and routes the same way.
    await svc.stop()
    again = await started(nc, prefix)
    try:
        await eventually(again.follower.ready.is_set, what="the snapshot on start")
        assert again.index.replica_blocks("r1") == len(keys)
        p = again.routing.prefix("sim", BODY, None)
        assert again.routing.choose("sim", eps, p, 0.0, random.Random(0)) is eps[1]
        # r1 leaves the routing table: dropped from the index, and the request goes by load.
        again.routing_changed([ModelProfile(name="sim", engine="sim")], ["r0", "r2"])
        assert again.index.replicas() == ["r2"]
    finally:
        await again.stop()
