"""End to end with the real nats-server: fake agents publish real messages, the control plane places
replicas into ``<prefix>_assign`` and publishes endpoints into ``<prefix>_routing``."""

from __future__ import annotations

import logging

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.messages import Assignment, RoutingEndpoints, ShardState
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.routing_rows import read_routing
from tests.controlplane.cp_helpers import RunningCP, cp_settings, start_cp
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually


async def _assignments(nc: NATS, prefix: str) -> dict[str, Assignment]:
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_assign)
    out: dict[str, Assignment] = {}
    for k in await bus.kv_keys(kv):
        a, _ = await bus.kv_get(kv, k, Assignment)
        if a is not None and a.shards:
            out[k] = a
    return out


async def _endpoints(nc: NATS, prefix: str) -> RoutingEndpoints | None:
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_routing)
    ep = await read_routing(kv)
    return ep


@pytest.mark.slow
async def test_fake_agents_get_assignments_then_endpoints(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    agents = [FakeAgent(bus_nc, prefix, f"gpu-{i}") for i in range(2)]
    beating = Beating(agents, 0.1)
    try:
        for a in agents:
            await a.send_inventory()
        beating.start()
        got = await eventually(lambda: _assignments(bus_nc, prefix), what="assignments written")
        shards = [(node, s) for node, a in got.items() for s in a.shards]
        assert sorted(s.model for _, s in shards) == ["cpu-model", "small"]
        fence = next(iter(got.values())).fence
        assert fence == run.cp.lease.fence and fence > 0
        small = next((n, s) for n, s in shards if s.model == "small")
        assert len(small[1].gpus) == 1 and small[1].port > 0

        # Not ready yet: the router is told why, in the user's terms.
        ep = await eventually(lambda: _endpoints(bus_nc, prefix), what="routing endpoints published")
        assert ep is not None
        assert "small" not in ep.endpoints
        assert "small" in ep.unavailable

        by_node = {a.node: a for a in agents}
        for node, s in shards:
            await by_node[node].report(s.replica_id, s.shard, s.model, ShardState.READY, s.port)

        async def both_ready() -> RoutingEndpoints | None:
            e = await _endpoints(bus_nc, prefix)
            return e if e and set(e.endpoints) == {"small", "cpu-model"} else None

        ep = await eventually(both_ready, what="endpoints for both small and cpu-model")
        assert ep is not None
        url = ep.endpoints["small"][0].url
        assert url == f"http://127.0.0.1:{small[1].port}"
        assert ep.unavailable == {}
        v1 = ep.version

        # Steady state: nothing changes, nothing is rewritten.
        writes = run.cp.assignments.writes
        passes = run.cp.passes
        await eventually(lambda: run.cp.passes > passes + 5, what="five more reconcile passes")
        assert run.cp.assignments.writes == writes
        now = await _endpoints(bus_nc, prefix)
        assert now is not None and now.version == v1
    finally:
        await beating.stop()
        await run.stop()


@pytest.mark.slow
async def test_lost_node_replica_rebuilt_and_old_shard_dropped(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(
        cp_settings(nats_server.url, prefix),
        catalog_text="""
models:
  - name: small
    engine: sim
    replicas: 1
    gpu_class: H100-80GB
""",
    )
    agents = [FakeAgent(bus_nc, prefix, f"gpu-{i}") for i in range(2)]
    beating = Beating(agents, 0.1)
    try:
        for a in agents:
            await a.send_inventory()
        beating.start()
        got = await eventually(lambda: _assignments(bus_nc, prefix), what="the replica assigned")
        ((first_node, a1),) = got.items()
        s = a1.shards[0]
        by_node = {a.node: a for a in agents}
        await by_node[first_node].report(s.replica_id, 0, "small", ShardState.READY, s.port)
        await eventually(lambda: _has_endpoint(bus_nc, prefix, "small"), what="an endpoint for small")

        # The node goes silent: unreachable, then lost; the replica is rebuilt on the survivor.
        beating.paused.add(first_node)
        other = next(n for n in by_node if n != first_node)

        async def moved() -> dict[str, Assignment] | None:
            g = await _assignments(bus_nc, prefix)
            return g if other in g and first_node not in g else None

        g = await eventually(moved, timeout=10, what=f"the replica moved from {first_node} to {other}")
        assert g is not None
        assert g[other].shards[0].replica_id != s.replica_id
        # The lost node's endpoint is withdrawn (published in the same pass, just after the assignment).
        await eventually(lambda: _no_endpoint(bus_nc, prefix, "small"), what="small's endpoint withdrawn")
        # The lost node's assignment no longer holds the replaced shard: if it comes back, it stops it.
        kv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_assign)
        old, _ = await bus.kv_get(kv, first_node, Assignment)
        assert old is not None and old.shards == ()
        node_view = run.cp.state.nodes[first_node]
        assert str(run.cp.state.health(node_view, run.cp.clock())) == "lost"
        # It returns: it reports healthy again and gets nothing new.
        beating.paused.discard(first_node)
        await eventually(lambda: _ready_node(run, first_node), what=f"{first_node} ready again")
    finally:
        await beating.stop()
        await run.stop()


def _ready_node(run: RunningCP, node: str) -> bool:
    return str(run.cp.state.health(run.cp.state.nodes[node], run.cp.clock())) == "ready"


async def _no_endpoint(nc: NATS, prefix: str, model: str) -> bool:
    e = await _endpoints(nc, prefix)
    return e is not None and model not in e.endpoints and model in e.unavailable


async def _has_endpoint(nc: NATS, prefix: str, model: str) -> bool:
    e = await _endpoints(nc, prefix)
    return e is not None and model in e.endpoints


async def test_garbage_on_every_subject_is_dropped_with_one_line_each(
    nats_server: NatsServer, prefix: str, bus_nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    subj = Subjects(prefix)
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    try:
        with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
            bad = [
                b"\xc1",
                b"",
                b"\x93\x01\x02\x03",
                b"\x81\xa2_v\x63",
            ]  # not msgpack, empty, list, bad version
            subjects = [
                subj.heartbeat("gpu-0"),
                subj.inventory("gpu-0"),
                subj.status("gpu-0"),
                # (load reports are the routers' alone: the control plane does not listen to them)
                subj.idle("r1"),
                subj.usage("r1"),
            ]
            for s in subjects:
                for b in bad:
                    await bus_nc.publish(s, b)
            await bus.flush(bus_nc)
            await eventually(
                lambda: run.cp.drops.count >= len(bad) * len(subjects), what="every garbage message dropped"
            )
        lines = [r for r in caplog.records if "dropped undecodable" in r.getMessage()]
        assert len(lines) == len(bad) * len(subjects)
        # It keeps working: a real agent is still placed on.
        await agent.send_inventory()
        await agent.beat()
        got = await eventually(lambda: _assignments(bus_nc, prefix), what="gpu-0 placed on")
        assert "gpu-0" in got
    finally:
        await run.stop()


async def test_a_node_heard_without_inventory_is_asked_for_it(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    """An inventory sent before the control plane listened is asked for again, not awaited for 60 s."""
    run = await start_cp(cp_settings(nats_server.url, prefix))
    agent = FakeAgent(bus_nc, prefix, "gpu-late")
    asked: list[str] = []

    async def answer(msg: Msg) -> None:
        asked.append(msg.subject)
        await agent.send_inventory()

    sub = await bus_nc.subscribe(Subjects(prefix).inventory_request("gpu-late"), cb=answer)
    beating = Beating([agent], 0.1)
    try:
        beating.start()  # heartbeats only: the inventory went out before the control plane listened
        got = await eventually(lambda: _assignments(bus_nc, prefix), what="gpu-late placed on")
        assert "gpu-late" in got
        # Asked once per few heartbeat intervals at most, and not again once it has the inventory.
        assert 1 <= len(asked) <= 2, asked
    finally:
        await beating.stop()
        await sub.unsubscribe()
        await run.stop()
