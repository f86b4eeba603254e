"""Forged node messages on the real bus: one bad heartbeat must neither stop nor freeze a node's replicas."""

from __future__ import annotations

import logging
import time

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import encode
from llmgw_common.messages import Heartbeat, RoutingEndpoints, ShardState, ShardStatus
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.controlplane.test_cp_e2e import _assignments, _endpoints
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually


@pytest.mark.slow
async def test_forged_heartbeats_change_nothing_and_genuine_ones_still_count(
    nats_server: NatsServer, prefix: str, bus_nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    cp = run.cp
    subj = Subjects(prefix)
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    beating = Beating([agent], 0.1)
    try:
        await agent.send_inventory()
        beating.start()
        got = await eventually(lambda: _assignments(bus_nc, prefix), what="gpu-0's assignment written")
        shards = [s for s in got["gpu-0"].shards]
        for s in shards:
            await agent.report(s.replica_id, s.shard, s.model, ShardState.READY, s.port)

        async def both_serving() -> RoutingEndpoints | None:
            e = await _endpoints(bus_nc, prefix)
            return e if e and set(e.endpoints) == {"small", "cpu-model"} else None

        serving = await eventually(both_serving, what="endpoints for both small and cpu-model")
        assert serving is not None
        before = serving.endpoints
        records = set(cp.state.replicas)

        def forged_hb(**over: object) -> bytes:
            hb = {"node": "gpu-0", "boot_id": agent.boot_id, "seq": agent.seq + 1, "sent_at": time.time()}
            return encode(Heartbeat.model_validate({**hb, **over}))

        small = next(s for s in shards if s.model == "small")
        with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
            for data in (
                forged_hb(boot_id="forged-boot", seq=1),  # "the agent restarted and runs nothing"
                forged_hb(seq=2**62),  # every genuine heartbeat after it would look like a replay
                forged_hb(sent_at=1e300),  # every genuine status after it would look old
                forged_hb(sent_at=float("nan")),
            ):
                await bus_nc.publish(subj.heartbeat("gpu-0"), data)
            forged_status = ShardStatus(
                node="gpu-0",
                boot_id="forged-boot",
                sent_at=time.time(),
                replica_id=small.replica_id,
                shard=small.shard,
                model=small.model,
                state=ShardState.FAILED,
                port=small.port,
                error="forged",
            )
            await bus_nc.publish(subj.status("gpu-0"), encode(forged_status))
            await bus.flush(bus_nc)
            # Many passes and genuine heartbeats later, nothing has moved.
            passes, seq = cp.passes, agent.seq
            await eventually(lambda: cp.passes >= passes + 20, what="twenty more reconcile passes")
            await eventually(lambda: agent.seq >= seq + 10, what="ten more genuine heartbeats")
        after = await _endpoints(bus_nc, prefix)
        assert after is not None and after.endpoints == before
        assert set(cp.state.replicas) == records
        node = cp.state.nodes["gpu-0"]
        assert node.boot_id == agent.boot_id and node.restarts == 0
        assert {k: r.state for k, r in node.shards.items()} == {
            (s.replica_id, s.shard): ShardState.READY for s in shards
        }
        said = [r.getMessage() for r in caplog.records if "not believed from node gpu-0" in r.getMessage()]
        assert any("no inventory from 'forged-boot'" in m for m in said), said
        assert any("seq jumped" in m for m in said), said
        assert any("1e+300" in m for m in said), said
        # Every forged message was refused; the log says each kind of reason once (rate-limited).
        assert cp.doubts.count >= 5 and len(said) == 3, said

        # A genuine change still gets through: the agent reports the small replica failed, and the
        # control plane replaces it.
        await agent.report(small.replica_id, small.shard, small.model, ShardState.FAILED, small.port, "OOM")

        def replaced() -> bool:
            return small.replica_id not in cp.state.replicas and any(
                r.model == "small" for r in cp.state.replicas.values()
            )

        await eventually(replaced, what="the failed small replica replaced")
    finally:
        await beating.stop()
        await run.stop()


async def test_a_restarted_agent_whose_inventory_was_missed_is_asked_to_prove_its_boot(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    """Heartbeats of an unproven boot are not believed; the node is asked for the inventory that proves it."""
    run = await start_cp(cp_settings(nats_server.url, prefix))
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    beating = Beating([agent], 0.1)
    asked: list[str] = []

    async def answer(msg: Msg) -> None:
        asked.append(agent.boot_id)
        await agent.send_inventory()

    sub = None
    try:
        await agent.send_inventory()
        beating.start()
        await eventually(lambda: _assignments(bus_nc, prefix), what="gpu-0's assignment written")
        node = run.cp.state.nodes["gpu-0"]
        # The agent restarts; its first inventory never reached the control plane.
        agent.boot_id, agent.seq = "boot-2", 0
        sub = await bus_nc.subscribe(Subjects(prefix).inventory_request("gpu-0"), cb=answer)
        await bus.flush(bus_nc)

        def restarted() -> bool:
            return node.boot_id == "boot-2" and node.restarts == 1

        await eventually(restarted, what="the restart believed once the inventory proves it")
        assert asked and set(asked) == {"boot-2"}
        assert not run.cp.state.wants_inventory("gpu-0")
    finally:
        await beating.stop()
        if sub is not None:
            await sub.unsubscribe()
        await run.stop()
