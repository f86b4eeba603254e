"""What one node's reports may leave in the control plane's tables, on the real bus.

Per-node permissions let an agent (or whoever holds its credentials) publish only on its own subjects,
but within them it names replica ids freely. Its reports must neither speak for another node's replicas
nor leave entries behind that nothing ever removes (a flood of invented ids would grow memory without end).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.messages import LoadReport, ReplicaLoad, ShardState, ShardStatus
from llmgw_common.subjects import Subjects
from llmgw_controlplane.state import ClusterState
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.controlplane.test_cp_e2e import _assignments
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually

INVENTED = "invented-"


def _ids_held(state: ClusterState) -> set[str]:
    """Every replica id any of the state's tables is keyed by (node shard tables included)."""
    out: set[str] = set()

    def keys(table: Iterable[object]) -> None:
        for k in table:
            if isinstance(k, str):
                out.add(k)
            elif isinstance(k, tuple) and k and isinstance(k[0], str):
                out.update(x for x in k if isinstance(x, str))

    for value in vars(state).values():
        if isinstance(value, dict | set):
            keys(value)
    for rec in state.nodes.values():
        for f in dataclasses.fields(rec):
            value = getattr(rec, f.name)
            if isinstance(value, dict | set):
                keys(value)
    return out


async def _ready_everywhere(bus_nc: NATS, prefix: str, agents: dict[str, FakeAgent]) -> dict[str, str]:
    """Wait for the assignments, report every shard ready; replica id -> its node."""
    got = await eventually(lambda: _assignments(bus_nc, prefix), what="assignments written")
    where = {}
    for node, a in got.items():
        for s in a.shards:
            await agents[node].report(s.replica_id, s.shard, s.model, ShardState.READY, s.port)
            where[s.replica_id] = node
    return where


async def test_a_node_cannot_put_errors_or_log_lines_on_another_nodes_replica(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    agents = {n: FakeAgent(bus_nc, prefix, n) for n in ("gpu-0", "gpu-1")}
    beating = Beating(list(agents.values()), 0.1)
    client = CtlClient(bus_nc, prefix, timeout=5.0)
    try:
        for a in agents.values():
            await a.send_inventory()
        beating.start()
        where = await _ready_everywhere(bus_nc, prefix, agents)
        rid, node = sorted(where.items())[0]
        other = next(n for n in agents if n != node)
        beating.paused.add(other)  # its next heartbeat would replace the shard this check waits for
        forged = ShardStatus(
            node=other,
            boot_id=agents[other].boot_id,
            sent_at=time.time(),
            replica_id=rid,
            shard=0,
            model="small",
            state=ShardState.FAILED,
            error="forged by " + other,
            log_tail=("rm -rf / finished",),
        )
        await bus_nc.publish(Subjects(prefix).status(other), encode(forged))
        await bus.flush(bus_nc)
        await eventually(lambda: _has_shard(run.cp.state, other, rid), what=f"{other}'s forged report heard")

        rep = next(r for r in (await client.replicas()).replicas if r.id == rid)
        (shard,) = rep.shards
        assert shard.node == node and shard.state == "ready"
        assert shard.error is None and shard.log_tail == (), shard
        assert rep.error is None
    finally:
        await beating.stop()
        await run.stop()


def _has_shard(state: ClusterState, node: str, rid: str) -> bool:
    return (rid, 0) in state.nodes[node].shards


@pytest.mark.slow
async def test_invented_replica_ids_in_a_nodes_reports_leave_nothing_behind(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    cp = run.cp
    subj = Subjects(prefix)
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    beating = Beating([agent], 0.1)
    try:
        await agent.send_inventory()
        beating.start()
        await _ready_everywhere(bus_nc, prefix, {"gpu-0": agent})
        genuine = set(cp.state.replicas)
        invented = [f"{INVENTED}{i}" for i in range(200)]
        # Load figures, failures with log tails, and ready shards for replicas nobody placed ...
        await bus_nc.publish(
            subj.load("gpu-0"),
            encode(
                LoadReport(
                    node="gpu-0",
                    sent_at=time.time(),
                    replicas=tuple(ReplicaLoad(replica_id=r) for r in invented),
                )
            ),
        )
        for r in invented[:50]:
            await agent.report(r, 0, "small", ShardState.FAILED, None, error="boom", log_tail=("x" * 200,))
        for r in invented[50:100]:
            await agent.report(r, 0, "small", ShardState.READY, 30000)
        await eventually(
            lambda: _has_shard(cp.state, "gpu-0", invented[99]), what="the invented shard reports heard"
        )
        # ... then the agent restarts (proven by its inventory) and reports only what it runs.
        for r in invented[:100]:
            del agent.shards[(r, 0)]
        agent.boot_id, agent.seq = "boot-2", 0
        await agent.send_inventory()

        def restarted() -> bool:
            return cp.state.nodes["gpu-0"].boot_id == "boot-2" and (invented[99], 0) not in (
                cp.state.nodes["gpu-0"].shards
            )

        await eventually(restarted, what="gpu-0's restart seen and its invented shards dropped")
        passes = cp.passes

        def clean() -> bool:
            return cp.passes > passes + 3 and not any(r.startswith(INVENTED) for r in _ids_held(cp.state))

        try:
            await eventually(clean, timeout=5.0, what="no invented id held after three passes")
        except AssertionError:
            held = sorted(r for r in _ids_held(cp.state) if r.startswith(INVENTED))
            raise AssertionError(f"{len(held)} invented ids still held, e.g. {held[:3]}") from None
        assert genuine <= set(cp.state.replicas)
    finally:
        await beating.stop()
        await run.stop()
