"""A warm start routes nothing that no agent confirmed since this control plane started (issue 25's 502s).

`docker compose up` with NATS's volume kept: the replica records and the routing table of the previous
run are still in KV, naming engines of the previous run. Until the node's agent reports the replica to
this control plane, the table it writes must not list that endpoint (routers would send requests to an
engine that may not be there, and answer 502); once reported, it does.
"""

from __future__ import annotations

import time

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.catalog import parse_catalog
from llmgw_common.codec import encode
from llmgw_common.messages import ReplicaRecord, RoutingEndpoints, ShardPlacement, ShardState
from llmgw_common.subjects import Subjects
from llmgw_controlplane.scheduler.phase import ReplicaPhase, replica_status, serving
from llmgw_controlplane.scheduler.routing import FIRST_PLACEMENT, takeover_content
from llmgw_controlplane.service import ControlPlane
from llmgw_controlplane.state import ClusterState
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.routing_rows import read_routing
from tests.controlplane.cp_helpers import cp_settings
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually
from tests.placement.placement_kit import node, profile, replica, snap

CATALOG = "models:\n  - {name: w, engine: sim, startup_timeout_s: 100000}\n"


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def _stored(nc: NATS, prefix: str) -> RoutingEndpoints | None:
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_routing)
    ep = await read_routing(kv)
    return ep


async def _table(nc: NATS, prefix: str) -> RoutingEndpoints:
    ep = await _stored(nc, prefix)
    assert ep is not None, "no routing table in KV"
    return ep


def _urls(ep: RoutingEndpoints) -> set[str]:
    return {e.url for eps in ep.endpoints.values() for e in eps}


@pytest.mark.slow
async def test_a_warm_start_routes_only_what_an_agent_confirmed_since(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    clock = Clock(time.time())  # the agent stamps its messages with the real time
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_desired, history=5)
    await kv.create("catalog", encode(parse_catalog(CATALOG)))

    # The previous run: its replica placed, reported ready and routed.
    s1 = cp_settings(nats_server.url, prefix, lease_ttl_s=60.0, node_lost_s=100_000.0, settle_s=0.0)
    nc1 = await bus.connect(s1, "cp-test-1", wait=False)
    cp1 = ControlPlane(s1, nc1, clock=clock, holder="cp-1")
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    try:
        await cp1.start()
        assert await cp1.lease.step()
        await cp1._become_leader()
        # A fresh bucket: nothing to supersede, so the first pass writes the table (after the ctl and
        # wake endpoints are up, which tests and routers take a table as the sign of).
        assert await _stored(bus_nc, prefix) is None
        await agent.send_inventory()
        await eventually(
            lambda: (n := cp1.state.nodes.get("gpu-0")) is not None and n.inventory is not None,
            what="gpu-0's inventory taken",
        )
        await cp1._tick(clock())
        (rid,) = cp1.state.replicas
        port = cp1.state.replicas[rid].shards[0].port

        async def ready_in(cp: ControlPlane) -> bool:
            await agent.report(rid, 0, "w", ShardState.READY, port)
            await agent.beat()
            rep = cp.state.nodes["gpu-0"].shards.get((rid, 0))
            return rep is not None and rep.state is ShardState.READY

        await eventually(lambda: ready_in(cp1), what="the shard known ready")
        await cp1._tick(clock())
        old = await _table(bus_nc, prefix)
        (url,) = _urls(old)
    finally:
        await cp1.close()
        await nc1.close()

    # The next run: the same records and table in KV; the agent has not reported yet.
    clock.t += 60.0
    s2 = cp_settings(nats_server.url, prefix, lease_ttl_s=60.0, node_lost_s=100_000.0, settle_s=6.0)
    nc2 = await bus.connect(s2, "cp-test-2", wait=False)
    cp2 = ControlPlane(s2, nc2, clock=clock, holder="cp-2")
    agent.boot_id, agent.shards = "boot-2", {}
    try:
        await cp2.start()
        assert await cp2.lease.step()
        await cp2._become_leader()
        assert set(cp2.state.replicas) == {rid}, "the previous run's record was not loaded"
        # Taken at once (the lease was released), before any agent had a heartbeat period to report:
        # the rewrite waits 1.5 periods of listening (0.3 s here), then comes from the loop's tick.
        assert (await _table(bus_nc, prefix)).version == old.version
        clock.t += 0.35
        await cp2._tick(clock())
        taken = await _table(bus_nc, prefix)
        assert url not in _urls(taken), f"routed at takeover, unconfirmed since this start: {taken}"
        assert taken.version > old.version, "the takeover's table must supersede the previous run's"
        assert "w" in taken.coming, "routers should hold requests for the unconfirmed replica, not refuse"

        # Still settling, and still unreported: not routed.
        clock.t += 0.65
        await cp2._tick(clock())
        assert url not in _urls(await _table(bus_nc, prefix))

        # Settled, still unreported (the agent is not up yet): not routed.
        clock.t += 6.0
        await cp2._tick(clock())
        assert url not in _urls(await _table(bus_nc, prefix))

        # The agent comes back and reports the replica ready: routed.
        await agent.send_inventory()
        await eventually(lambda: ready_in(cp2), what="the shard known ready by the new control plane")
        await cp2._tick(clock())
        assert url in _urls(await _table(bus_nc, prefix)), "a confirmed ready replica must be routed"
    finally:
        await cp2.close()
        await nc2.close()


@pytest.mark.slow
async def test_a_clean_restart_with_agents_beating_withdraws_no_endpoint(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    """A control plane that restarts cleanly gives its lease up and takes it again at once, before any
    heartbeat reached the new process: its takeover table routed nothing (every replica "coming"), and
    routers held all traffic until the first pass, settle_s on. It waits a heartbeat period and a half
    of listening, so the table after the takeover still lists the endpoints the agents report ready."""
    clock = Clock(time.time())
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_desired, history=5)
    await kv.create("catalog", encode(parse_catalog(CATALOG)))
    s = cp_settings(nats_server.url, prefix, lease_ttl_s=60.0, node_lost_s=100_000.0, settle_s=0.0)
    nc1 = await bus.connect(s, "cp-test-1", wait=False)
    cp1 = ControlPlane(s, nc1, clock=clock, holder="cp-1")
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    beating = Beating([agent], 0.1)
    try:
        await cp1.start()
        assert await cp1.lease.step()
        await cp1._become_leader()
        await agent.send_inventory()
        await eventually(
            lambda: (n := cp1.state.nodes.get("gpu-0")) is not None and n.inventory is not None,
            what="gpu-0's inventory taken",
        )
        await cp1._tick(clock())
        (rid,) = cp1.state.replicas
        port = cp1.state.replicas[rid].shards[0].port
        await agent.report(rid, 0, "w", ShardState.READY, port)
        beating.start()

        def ready_in(cp: ControlPlane) -> bool:
            n = cp.state.nodes.get("gpu-0")
            rep = n.shards.get((rid, 0)) if n is not None else None
            return rep is not None and rep.state is ShardState.READY

        await eventually(lambda: ready_in(cp1), what="the shard known ready")
        await cp1._tick(clock())
        (url,) = _urls(old := await _table(bus_nc, prefix))
    finally:
        await cp1.close()  # gives the lease up
        await nc1.close()

    # The restart, settling as by default; the agent beats on, as agents do through a restart.
    clock.t += 1.0
    s2 = cp_settings(nats_server.url, prefix, lease_ttl_s=60.0, node_lost_s=100_000.0, settle_s=6.0)
    nc2 = await bus.connect(s2, "cp-test-2", wait=False)
    cp2 = ControlPlane(s2, nc2, clock=clock, holder="cp-2")
    try:
        await cp2.start()
        assert await cp2.lease.step(), "the released lease must be taken at once"
        await cp2._become_leader()
        assert url in _urls(await _table(bus_nc, prefix)), "withdrawn at takeover, before any heartbeat"
        await eventually(lambda: ready_in(cp2), what="the new control plane to hear the ready shard")
        clock.t += 0.35  # over 1.5 heartbeat periods (0.2 s) of listening: the takeover rewrite is due
        await cp2._tick(clock())
        assert cp2.leadership.table_due is None, "the takeover's rewrite did not come"
        taken = await _table(bus_nc, prefix)
        # The same content as the previous run's table, so not written again (versions stay put).
        assert url in _urls(taken), f"a replica its agent reports ready was withdrawn: {taken}"
        assert taken.version == old.version and "w" not in taken.coming
    finally:
        await beating.stop()
        await cp2.close()
        await nc2.close()


def test_records_of_a_previous_run_are_not_serving_until_their_node_reports() -> None:
    """The state side: a record loaded at takeover, its node known only from the record, is starting,
    not ready, whatever the previous run last saw of it."""
    st = ClusterState(heartbeat_interval_s=2.0, unreachable_after_missed=3, node_lost_s=30.0)
    rec = ReplicaRecord(
        id="r1", model="m", created=0.0, shards=(ShardPlacement(shard=0, node="a", gpus=(0,), port=20000),)
    )
    st.set_replicas({"r1": rec})
    st.know_node("a", 100.0)
    st.set_observed_from(100.0)
    s = st.snapshot(101.0)
    (view,) = s.replicas
    assert view.shards[0].state is None
    assert replica_status(s, view).phase is ReplicaPhase.STARTING
    assert not serving(s, view)


def test_the_takeover_table_routes_only_reported_replicas_and_keeps_what_is_cold() -> None:
    models = [profile("m", replicas=1), profile("z", replicas=1, min_replicas=0, idle_after=60.0)]
    unreported = replica("r1", "m", [("a", (0,))], created=990.0, state=None, port=20000)
    s = snap([node("a")], [unreported], models)
    endpoints, unavailable, coming, cold = takeover_content(s, ("z", "gone"))
    assert endpoints == {}
    assert coming == {"m": "1 replica starting on a"}
    # z had nothing running and still has nothing: still cold (a request wakes it); gone left the catalog.
    assert cold == ("z",)
    assert unavailable["z"].startswith("scaled to zero after")
    assert unavailable["m"].startswith("no ready replica: 1 starting on a")

    reported = replica("r1", "m", [("a", (0,))], created=0.0, state=ShardState.READY, port=20000)
    placed = replica("r2", "z", [("a", (1,))], created=990.0, state=None, port=20010)
    endpoints, unavailable, coming, cold = takeover_content(
        snap([node("a")], [reported, placed], models), ("z",)
    )
    assert [e.replica_id for e in endpoints["m"]] == ["r1"]
    # z has a replica again (placed by the previous run, not yet reported): on its way, not cold.
    assert cold == () and coming == {"z": "1 replica starting on a"}


def test_the_takeover_table_holds_a_model_whose_first_replica_the_first_pass_places() -> None:
    """A new cluster (or a catalog applied while no control plane led): nothing placed yet. Until the
    first pass, once settled, routers hold its requests rather than refuse them for those seconds (a cold
    compose up answered 11 requests 503 "no replica placed yet" before its first chat). A model that
    starts cold (floor 0), asks for no replica, or was placed already is left as before."""
    models = [
        profile("new", replicas=2),
        profile("z", replicas=1, min_replicas=0, idle_after=60.0),
        profile("none", replicas=0),
        profile("m", replicas=1),
    ]
    unreported = replica("r1", "m", [("a", (0,))], created=990.0, state=None, port=20000)
    endpoints, unavailable, coming, cold = takeover_content(snap([node("a")], [unreported], models), ())
    assert endpoints == {}
    assert coming == {"new": FIRST_PLACEMENT, "m": "1 replica starting on a"}
    assert cold == ()
    # What a router says if the first pass takes it off the way (it could not be placed): the pass's
    # own table then carries the reconciler's reason instead.
    assert unavailable["new"] == "no replica placed yet"
    assert unavailable["none"] == "the catalog asks for 0 replicas of this model"
    assert "z" not in coming and "none" not in coming
