"""The routing table as one row per model (issue 35), written by the control plane's real publisher and
followed by real routers: a change to one model costs a router that row whatever the table holds, no
message passes NATS's 1 MB ``max_payload`` (the session's nats-server has the default: a bigger put is
refused), a router started later reads the whole table, and a takeover from a control plane that wrote
the old whole table rewrites it as rows."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, RoutingCatalog, RoutingEndpoints
from llmgw_common.routing_table import ROUTING_HEAD, row_key
from llmgw_common.subjects import ROUTING_ENDPOINTS, Subjects
from llmgw_controlplane.routing_publisher import RoutingPublisher
from llmgw_router.service import Router
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.routing_rows import read_routing
from tests.kit.poll import eventually
from tests.kit.ports import free_port
from tests.router.router_helpers import RouterFactory

PER_MODEL = 5


def _table(models: int, url_tag: str = "") -> dict[str, tuple[Endpoint, ...]]:
    return {
        f"model-{m:05d}": tuple(
            Endpoint(
                replica_id=f"r-{m:05d}-{i}",
                model=f"model-{m:05d}",
                url=f"http://10.{m // 250}.{m % 250}.{i}:8000{url_tag}",
                node=f"node-{m:05d}-{i}",
            )
            for i in range(PER_MODEL)
        )
        for m in range(models)
    }


async def _publisher(nc: NATS, prefix: str) -> RoutingPublisher:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_routing)
    pub = RoutingPublisher(kv, bus.DropLog(logging.getLogger("test")))
    await pub.load()
    return pub


async def _router(
    routers: RouterFactory, nats_server: NatsServer, prefix: str, rid: str, **kw: object
) -> Router:
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, router_id=rid, **kw)
    await asyncio.wait_for(r.synced.wait(), 30)
    return r


def _urls(r: Router, model: str) -> set[str]:
    return {e.url for e in r.ctx.pool.by_model.get(model, ())}


async def _bytes_for_one_change(
    nats_server: NatsServer, nc: NATS, prefix: str, routers: RouterFactory, models: int
) -> float:
    pub = await _publisher(nc, prefix)
    table = _table(models)
    await pub.publish_endpoints(table, {})
    r = await _router(routers, nats_server, prefix, f"rows{models}")
    assert sum(len(v) for v in r.ctx.pool.by_model.values()) == models * PER_MODEL
    assert r.nc is not None
    await asyncio.sleep(0.3)
    changed = dict(table)
    moved = "model-00007"
    changed[moved] = _table(8, "/v2")[moved]
    b0 = r.nc.stats["in_bytes"]
    assert await pub.publish_endpoints(changed, {})
    want = {e.url.rstrip("/") for e in changed[moved]}
    await eventually(lambda: _urls(r, moved) == want, timeout=10, every=0.01, what="the router acting on it")
    took = r.nc.stats["in_bytes"] - b0
    # The others untouched.
    assert _urls(r, "model-00003") == {e.url for e in table["model-00003"]}
    return took


@pytest.mark.slow
async def test_a_change_to_one_model_costs_a_router_the_same_at_500_and_5000_endpoints(
    nats_server: NatsServer, nc: NATS, prefix: str, routers: RouterFactory
) -> None:
    small = await _bytes_for_one_change(nats_server, nc, f"{prefix}s", routers, 100)
    large = await _bytes_for_one_change(nats_server, nc, f"{prefix}l", routers, 1000)
    # One row of 5 endpoints (~800 bytes) and its envelope; the whole table at 5,000 endpoints is 700 KB.
    assert large < 1.5 * small + 1_000, (small, large)
    assert large < 5_000, (small, large)


@pytest.mark.slow
async def test_20000_endpoints_go_out_with_no_message_over_1mb_and_a_later_router_reads_them_all(
    nats_server: NatsServer, nc: NATS, prefix: str, routers: RouterFactory
) -> None:
    pub = await _publisher(nc, prefix)
    table = _table(4000)
    whole = encode(RoutingEndpoints(version=1, endpoints=table))
    assert len(whole) > 1024 * 1024  # what the old single value was: refused by the server
    # Each row is one put: a row over max_payload would raise here.
    assert await pub.publish_endpoints(table, {"model-x": "needs 8 x H100, 0 free"})
    assert pub.row_bytes / pub.row_writes < 2_000
    r = await _router(routers, nats_server, prefix, "late", admin_port=free_port())
    pool = r.ctx.pool
    assert sum(len(v) for v in pool.by_model.values()) == 20_000
    assert pool.table_read and pool.unavailable == {"model-x": "needs 8 x H100, 0 free"}
    # What the router holds, on its admin listener (the fleet bench reads it there).
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{r.admin_port}/routing") as resp:
            whole = await resp.json()
        async with s.get(f"http://127.0.0.1:{r.admin_port}/routing", params={"model": "model-00001"}) as resp:
            one = await resp.json()
    assert whole["endpoints"] == 20_000 and whole["models"] == 4000 and whole["table_read"]
    assert [e["url"] for e in one["endpoints"]] == [e.url for e in table["model-00001"]]
    # A model that leaves the table leaves the router (its row deleted).
    del table["model-00042"]
    assert await pub.publish_endpoints(table, {})
    await eventually(
        lambda: "model-00042" not in pool.by_model and not pool.unavailable,
        timeout=10,
        every=0.02,
        what="the removed model gone",
    )
    stored = await read_routing(await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_routing))
    assert stored is not None and len(stored.endpoints) == 3999


@pytest.mark.slow
async def test_a_takeover_from_a_whole_table_writes_it_as_rows_and_the_router_follows(
    nats_server: NatsServer, nc: NATS, prefix: str, routers: RouterFactory
) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_routing)
    cat = Catalog(models=(ModelProfile(name="a", engine="sim"), ModelProfile(name="b:7b", engine="sim")))
    await kv.put("catalog", encode(RoutingCatalog(version=1, catalog=cat)))
    ep_a = Endpoint(replica_id="ra", model="a", url="http://127.0.0.1:9/a", node="n1")
    ep_b = Endpoint(replica_id="rb", model="b:7b", url="http://127.0.0.1:9/b", node="n2")
    old = RoutingEndpoints(version=7, endpoints={"a": (ep_a,), "b:7b": (ep_b,)}, cold=("c",))
    await kv.put(ROUTING_ENDPOINTS, encode(old))
    r = await _router(routers, nats_server, prefix, "legacy")
    assert _urls(r, "a") == {ep_a.url} and r.ctx.pool.endpoints_version == 7
    pub = await _publisher(nc, prefix)
    assert pub.stored_cold == ("c",) and pub.endpoints_version == 7
    # The new leader's first pass: b withdrawn, the rest as before.
    assert await pub.publish_endpoints({"a": (ep_a,)}, {"b:7b": "node n2 lost"}, cold=("c",))
    await eventually(lambda: not _urls(r, "b:7b"), timeout=10, every=0.02, what="b withdrawn by its row")
    assert _urls(r, "a") == {ep_a.url}
    assert r.ctx.pool.cold == frozenset({"c"}) and r.ctx.pool.endpoints_version > 7
    keys = set(await bus.kv_keys(kv))
    assert {ROUTING_HEAD, row_key("a"), row_key("b:7b"), row_key("c")} <= keys
    assert await bus.kv_get(kv, ROUTING_ENDPOINTS, RoutingEndpoints) == (None, 0)  # the whole table gone
    # A later control plane continues the rows and their versions.
    again = await _publisher(nc, prefix)
    assert again.endpoints_version == pub.endpoints_version and again.stored_cold == ("c",)
    await again.publish_endpoints({"a": (ep_a,)}, {"b:7b": "node n2 lost"}, cold=("c",))
    assert again.row_writes == 0 and again.endpoints_version == pub.endpoints_version  # nothing written
