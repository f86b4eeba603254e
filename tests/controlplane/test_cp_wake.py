"""Scale to zero, wake and eviction (issue 13) through the real nats-server: fake agents and a fake
router publish real messages, the control plane runs in-process."""

from __future__ import annotations

import asyncio
import time

import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import decode, encode
from llmgw_common.messages import Event, RoutingEndpoints, ShardState
from llmgw_common.router_messages import IdleReport, WakeReply, WakeRequest, WakeState
from llmgw_common.subjects import Subjects
from llmgw_controlplane.service import ControlPlane
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.routing_rows import read_routing
from tests.controlplane.cp_helpers import RunningCP, cp_settings, start_cp
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually

CATALOG = """
models:
  - {name: a, engine: sim, gpu_class: H100-80GB, replicas: 1, min_replicas: 0, idle_after: 1s}
  - {name: b, engine: sim, gpu_class: H100-80GB, replicas: 1, min_replicas: 0, idle_after: 1s}
  - {name: big, engine: sim, gpu_class: H100-80GB, gpus_per_node: 4, min_replicas: 0, idle_after: 1m}
  - {name: watched, engine: sim, min_replicas: 1, watch: {}}
"""


async def wake(nc: NATS, prefix: str, model: str, router: str = "r1") -> WakeReply:
    req = WakeRequest(model=model, router=router, sent_at=time.time())
    msg = await nc.request(Subjects(prefix).wake(router), encode(req), timeout=5)
    return decode(msg.data, WakeReply)


async def endpoints(nc: NATS, prefix: str) -> RoutingEndpoints | None:
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_routing)
    ep = await read_routing(kv)
    return ep


async def events(nc: NATS, prefix: str, kind: str) -> list[Event]:
    subj = Subjects(prefix)
    js = nc.jetstream()
    try:
        info = await js.stream_info(subj.events_stream)
    except nats.js.errors.NotFoundError:
        return []
    out = []
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        raw = await js.get_msg(subj.events_stream, seq)
        assert raw.data is not None
        ev = decode(raw.data, Event)
        if ev.kind == kind:
            out.append(ev)
    return out


class Router:
    """Publishes idle reports as a router does, every 0.2 s: started long ago, ``used`` its last uses."""

    def __init__(self, nc: NATS, prefix: str, router: str = "r1") -> None:
        self.nc, self.subjects, self.router = nc, Subjects(prefix), router
        self.used: dict[str, float] = {}
        # Replicas in constant use: stamped with the time of each report.
        self.busy: set[str] = set()
        self.since = time.time() - 3600
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.used.update({r: time.time() for r in self.busy})
            rep = IdleReport(
                router=self.router, since=self.since, sent_at=time.time(), last_used=dict(self.used)
            )
            await self.nc.publish(self.subjects.idle(self.router), encode(rep))
            await asyncio.sleep(0.2)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def ready_all(cp: ControlPlane, agent: FakeAgent) -> None:
    """The agent reports every replica the control plane placed on it ready."""
    for r in list(cp.state.replicas.values()):
        for s in r.shards:
            if s.node == agent.node and (r.id, s.shard) not in agent.shards:
                await agent.report(r.id, s.shard, r.model, ShardState.READY, s.port)


def replicas_of(cp: ControlPlane, model: str) -> list[str]:
    return [r.id for r in cp.state.replicas.values() if r.model == model]


async def test_a_cold_model_is_published_cold_then_woken_once_by_concurrent_wakes(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix), CATALOG)
    agent = FakeAgent(bus_nc, prefix, "n1", gpus=1, memory_gb=None)
    beating = Beating([agent], 0.1)
    try:
        await agent.send_inventory()
        beating.start()

        async def cold() -> RoutingEndpoints | None:
            ep = await endpoints(bus_nc, prefix)
            return ep if ep is not None and {"a", "b", "big"} <= set(ep.cold) else None

        ep = await eventually(cold, what="a, b and big published cold")
        assert ep is not None
        assert "scaled to zero" in ep.unavailable["a"] and "a" not in ep.coming
        assert replicas_of(run.cp, "a") == []

        replies = await asyncio.gather(*(wake(bus_nc, prefix, "a", f"r{i}") for i in range(8)))
        assert {r.state for r in replies} == {WakeState.WAKING}

        async def coming() -> RoutingEndpoints | None:
            ep = await endpoints(bus_nc, prefix)
            return ep if ep is not None and "starting on n1" in ep.coming.get("a", "") else None

        ep = await eventually(coming, what="a published as starting on n1")
        assert ep is not None
        assert "a" not in ep.cold
        assert len(replicas_of(run.cp, "a")) == 1
        await ready_all(run.cp, agent)

        async def served() -> list[Event]:
            return await events(bus_nc, prefix, "model.woken")

        woken = await eventually(served, what="a model.woken event")
        assert [e.subject for e in woken] == ["a"]
        assert 0 < woken[0].details["cold_start_s"] < 10
        assert (await wake(bus_nc, prefix, "a")).state is WakeState.SERVING
        # Eight wakes, one replica.
        assert len(replicas_of(run.cp, "a")) == 1
    finally:
        await beating.stop()
        await run.stop()


async def test_refusals_say_why(nats_server: NatsServer, prefix: str, bus_nc: NATS) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix), CATALOG)
    agent = FakeAgent(bus_nc, prefix, "n1", gpus=1, memory_gb=None)
    beating = Beating([agent], 0.1)
    try:
        await agent.send_inventory()
        beating.start()
        await eventually(lambda: endpoints(bus_nc, prefix), what="routing endpoints published")
        unknown = await wake(bus_nc, prefix, "nope")
        assert unknown.state is WakeState.REFUSED and "model nope is not in the catalog" in unknown.reason
        big = await wake(bus_nc, prefix, "big")
        assert big.state is WakeState.REFUSED
        assert "has 1 free H100-80GB, needs 4" in big.reason, big.reason
        assert replicas_of(run.cp, "big") == []
    finally:
        await beating.stop()
        await run.stop()


async def test_a_standby_does_not_answer_wakes(nats_server: NatsServer, prefix: str, bus_nc: NATS) -> None:
    s = cp_settings(nats_server.url, prefix)
    lead = await start_cp(s, CATALOG, holder="lead")
    await eventually(lambda: lead.cp.leader, what="the first control plane to lead")
    standby = await start_cp(s, CATALOG, holder="standby")
    try:
        inbox = bus_nc.new_inbox()
        got: list[bytes] = []

        async def cb(msg: Msg) -> None:
            got.append(msg.data)

        sub = await bus_nc.subscribe(inbox, cb=cb)
        await bus.flush(bus_nc)
        req = WakeRequest(model="a", router="r1", sent_at=time.time())
        await bus_nc.publish(Subjects(prefix).wake("r1"), encode(req), reply=inbox)
        await eventually(lambda: got, what="an answer to the wake")
        # A second round trip through the leader: had the standby answered the first, its reply would be
        # here by now (both heard the request at the same time).
        second = await wake(bus_nc, prefix, "a")
        assert second.state is WakeState.REFUSED and "no node has reported" in second.reason
        await bus.flush(bus_nc)
        assert len(got) == 1 and not standby.cp.leader
        await sub.unsubscribe()
    finally:
        await standby.stop()
        await lead.stop()


async def _woken_and_ready(run: RunningCP, bus_nc: NATS, prefix: str, agent: FakeAgent, model: str) -> str:
    assert (await wake(bus_nc, prefix, model)).state is WakeState.WAKING
    await eventually(lambda: replicas_of(run.cp, model), what=f"a replica of {model} placed")
    await ready_all(run.cp, agent)

    async def woken() -> list[Event]:
        return [e for e in await events(bus_nc, prefix, "model.woken") if e.subject == model]

    await eventually(woken, what=f"a model.woken event for {model}")
    (rid,) = replicas_of(run.cp, model)
    return rid


async def test_unknown_idle_scales_nothing_down(nats_server: NatsServer, prefix: str, bus_nc: NATS) -> None:
    # The node is not lost within the hour the test looks ahead (it keeps its replicas while silent).
    run = await start_cp(cp_settings(nats_server.url, prefix, node_lost_s=7200.0), CATALOG)
    agent = FakeAgent(bus_nc, prefix, "n1", gpus=1, memory_gb=None)
    beating = Beating([agent], 0.1)
    try:
        await agent.send_inventory()
        beating.start()
        await eventually(lambda: endpoints(bus_nc, prefix), what="routing endpoints published")
        rid = await _woken_and_ready(run, bus_nc, prefix, agent, "a")
        # No router reports: an hour later (3600 times idle_after) nothing is known idle, nothing stops.
        await run.cp.loop.pass_once(time.time() + 3600)
        assert replicas_of(run.cp, "a") == [rid]
        assert await events(bus_nc, prefix, "model.scaled_to_zero") == []
    finally:
        await beating.stop()
        await run.stop()


@pytest.mark.slow
async def test_known_idle_scales_a_watched_model_to_zero_and_cold_is_not_down(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    catalog = CATALOG + (
        "  - {name: w, engine: sim, min_replicas: 0, idle_after: 1s,"
        " watch: {allow_scale_to_zero: true, probe_every: 1s, budget: 0.5s}}\n"
    )
    run = await start_cp(cp_settings(nats_server.url, prefix), catalog)
    agent = FakeAgent(bus_nc, prefix, "n1", gpus=1, memory_gb=None)
    beating = Beating([agent], 0.1)
    router = Router(bus_nc, prefix)
    try:
        await agent.send_inventory()
        beating.start()
        await eventually(lambda: endpoints(bus_nc, prefix), what="routing endpoints published")
        await _woken_and_ready(run, bus_nc, prefix, agent, "w")
        router.start()  # it never routed to the replica: idle at least since the replica started
        gone = await eventually(
            lambda: events(bus_nc, prefix, "model.scaled_to_zero"), what="a model.scaled_to_zero event"
        )
        assert [e.subject for e in gone] == ["w"]
        assert replicas_of(run.cp, "w") == []

        async def cold() -> RoutingEndpoints | None:
            ep = await endpoints(bus_nc, prefix)
            return ep if ep is not None and "w" in ep.cold and "w" not in ep.endpoints else None

        await eventually(cold, what="w published cold with no endpoint")
        # Far past its watch budget with no ready replica: cold, not down.
        await run.cp.loop.pass_once(time.time() + 60)
        assert [e for e in await events(bus_nc, prefix, "model.down") if e.subject == "w"] == []
    finally:
        await router.stop()
        await beating.stop()
        await run.stop()


async def test_a_wake_evicts_the_idle_model_when_there_is_no_room(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix, eviction_min_residency_s=0.0), CATALOG)
    agent = FakeAgent(bus_nc, prefix, "n1", gpus=1, memory_gb=None)
    beating = Beating([agent], 0.1)
    router = Router(bus_nc, prefix)
    try:
        await agent.send_inventory()
        beating.start()
        await eventually(lambda: endpoints(bus_nc, prefix), what="routing endpoints published")
        a_id = await _woken_and_ready(run, bus_nc, prefix, agent, "a")
        # a is in use (a router routes to it all the time): known idle, for well under its idle_after.
        router.busy.add(a_id)
        router.start()
        await eventually(lambda: run.cp.idle.routers, what="the router's idle report heard")
        ctl = CtlClient(bus_nc, prefix)
        ex = await ctl.explain_placement("b")
        assert not ex.placeable and f"would evict {a_id} of a on n1 (idle for" in ex.eviction, ex.eviction

        reply = await wake(bus_nc, prefix, "b")
        assert reply.state is WakeState.WAKING, reply
        assert f"would evict {a_id} of a on n1" in reply.reason

        evicted = await eventually(
            lambda: events(bus_nc, prefix, "model.evicted"), what="a model.evicted event"
        )
        assert [(e.subject, e.details["replica"], e.details["for_model"]) for e in evicted] == [
            ("a", a_id, "b")
        ]
        await eventually(lambda: replicas_of(run.cp, "b"), what="a replica of b placed")
        assert replicas_of(run.cp, "a") == []
        # a is not placed back: its target went down with the eviction.
        await run.cp.loop.pass_once(time.time())
        assert replicas_of(run.cp, "a") == [] and len(replicas_of(run.cp, "b")) == 1
        st = await ctl.status()
        assert [(e.replica_id, e.model, e.for_model) for e in st.evictions] == [(a_id, "a", "b")]
        assert "a" in st.cold and "b" in st.waking and "a" in st.cold_starts
        # The fake agent reports ready at once: the cold start is tiny, but it is measured.
        assert 0 <= st.cold_starts["a"] < 10
    finally:
        await router.stop()
        await beating.stop()
        await run.stop()


@pytest.mark.slow
async def test_a_wake_while_settling_is_waking_and_served_once_settled(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    # Right after a start nothing is known of the nodes: a wake is taken, not refused for want of them.
    run = await start_cp(cp_settings(nats_server.url, prefix, settle_s=1.0), CATALOG)
    agent = FakeAgent(bus_nc, prefix, "n1", gpus=1, memory_gb=None)
    beating = Beating([agent], 0.1)
    try:
        # The leader flag flips before the wake endpoint is subscribed: until it is, "no responders".
        reply = await eventually(
            lambda: wake(bus_nc, prefix, "a"),
            tolerate=(nats.errors.NoRespondersError,),
            what="the new leader's wake endpoint to answer",
        )
        assert reply.state is WakeState.WAKING, reply
        await agent.send_inventory()
        beating.start()
        await eventually(lambda: replicas_of(run.cp, "a"), what="a replica of a placed once settled")
    finally:
        await beating.stop()
        await run.stop()
