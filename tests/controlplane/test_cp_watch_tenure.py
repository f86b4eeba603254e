"""The watch budget across leadership: what this process saw in an earlier tenure proves nothing now.

A control plane that led, stood by while another led, and leads again did not watch the models in
between: a model it last saw ready an hour ago and sees starting now has been without a ready replica
for an unknown time (the other leader said what there was to say), not for an hour.
"""

from __future__ import annotations

import time

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.catalog import parse_catalog
from llmgw_common.codec import encode
from llmgw_common.messages import ShardState
from llmgw_common.subjects import Subjects
from llmgw_controlplane.service import ControlPlane
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings
from tests.kit.agents import FakeAgent
from tests.kit.poll import eventually

CATALOG = (
    "models:\n  - {name: w, engine: sim, startup_timeout_s: 100000, watch: {budget: 30s, probe_every: 60s}}\n"
)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.mark.slow
async def test_leading_again_does_not_judge_an_outage_from_an_earlier_tenure(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    clock = Clock(time.time())  # the agent stamps its messages with the real time
    s = cp_settings(nats_server.url, prefix, lease_ttl_s=60.0, node_lost_s=100_000.0)
    nc = await bus.connect(s, "cp-test", wait=False)
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_desired, history=5)
    await kv.create("catalog", encode(parse_catalog(CATALOG)))
    cp = ControlPlane(s, nc, clock=clock)
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    try:
        await cp.start()
        assert await cp.lease.step()
        await cp._become_leader()
        await agent.send_inventory()

        def known() -> bool:
            node = cp.state.nodes.get("gpu-0")
            return node is not None and node.inventory is not None

        await eventually(known, what="gpu-0's inventory taken")
        await cp._tick(clock())
        (rid,) = cp.state.replicas
        port = cp.state.replicas[rid].shards[0].port

        async def shard(state: ShardState) -> bool:
            await agent.report(rid, 0, "w", state, port)
            await agent.beat()
            rep = cp.state.nodes["gpu-0"].shards.get((rid, 0))
            return rep is not None and rep.state is state

        await eventually(lambda: shard(ShardState.READY), what="the shard known ready")
        await cp._tick(clock())
        assert cp.detector.down == set()

        # Another control plane leads for an hour; this one stands by. Meanwhile the replica restarts.
        await cp._step_down()
        clock.t += 3600.0
        await eventually(lambda: shard(ShardState.STARTING), what="the restarted shard known starting")
        await cp._become_leader()
        await cp._tick(clock())
        assert cp.detector.down == set(), "model.down on the first pass of a new tenure"
        published = cp.events.published
        # Seen without a ready replica for a whole budget of this tenure, and never ready in it: starting.
        clock.t += 31.0
        await agent.beat()
        await cp._tick(clock())
        assert cp.detector.down == set() and cp.events.published == published
    finally:
        await cp.close()
        await nc.close()
