"""When the agent sends its inventory: on a change, on the interval, and when the control plane asks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_agent.service import serve
from llmgw_agent.settings import AgentSettings
from llmgw_common.codec import decode
from llmgw_common.messages import Inventory
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually

pytestmark = pytest.mark.e2e


async def test_inventory_sent_on_change_and_on_interval_only(nc: NATS, prefix: str, tmp_path: Path) -> None:
    from llmgw_agent.service import INVENTORY_CHECK_S, Agent

    labels = {"role": "a"}

    def collect(s: AgentSettings, boot_id: str, now: float) -> Inventory:
        return Inventory(node=s.node, boot_id=boot_id, sent_at=now, labels=dict(labels))

    s = AgentSettings(node="n8", prefix=prefix, state_dir=str(tmp_path), inventory_interval_s=60)
    sent: list[Inventory] = []

    async def on(msg: Msg) -> None:
        sent.append(decode(msg.data, Inventory))

    await nc.subscribe(Subjects(prefix).inventory("n8"), cb=on)
    agent = Agent(s, nc, collect=collect)
    try:
        for now, change in [(1000.0, None), (1001.0, "b"), (1000 + INVENTORY_CHECK_S, None), (1025.0, None)]:
            if change:
                labels["role"] = change  # changed, but not looked at before the next check
            await agent._inventory_if_due(now)
        await agent._inventory_if_due(1071.0)  # unchanged, but 60 s since the last one: sent again
        await bus.flush(nc)
        await eventually(lambda: len(sent) >= 3, timeout=5, what="three inventories on the bus")
        assert [(m.sent_at, m.labels["role"]) for m in sent] == [
            (1000.0, "a"),
            (1000 + INVENTORY_CHECK_S, "b"),
            (1071.0, "b"),
        ]
    finally:
        await agent.supervisor.aclose()


async def test_inventory_is_sent_again_when_the_control_plane_asks(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    s = AgentSettings(
        node="n9",
        prefix=prefix,
        nats_urls=[nats_server.url],
        state_dir=str(tmp_path),
        inventory_interval_s=600,
        load_interval_s=0.05,
        heartbeat_interval_s=0.01,
    )
    sent: list[Inventory] = []
    beats = 0

    async def on(msg: Msg) -> None:
        sent.append(decode(msg.data, Inventory))

    async def on_heartbeat(_msg: Msg) -> None:
        nonlocal beats
        beats += 1

    subj = Subjects(prefix)
    await nc.subscribe(subj.inventory("n9"), cb=on)
    await nc.subscribe(subj.heartbeat("n9"), cb=on_heartbeat)
    await bus.flush(nc)
    # The agent's clock, moved by the test: the interval is judged on it, not on how long we wait.
    now = [1_000_000.0]
    stop = asyncio.Event()
    agent = asyncio.create_task(
        serve(
            s,
            stop,
            collect=lambda s, b, t: Inventory(node=s.node, boot_id=b, sent_at=t),
            clock=lambda: now[0],
        )
    )
    try:

        async def ticks_pass() -> None:
            # Each tick sends its heartbeat (due at every tick here) before it judges the inventory: two
            # more heartbeats mean a whole tick judged it on the clock as it is now.
            seen = beats
            await eventually(lambda: beats >= seen + 2, every=0.01, what="two more heartbeats (ticks)")

        await eventually(lambda: len(sent) >= 1, every=0.01, what="the first inventory")
        now[0] += 599.0  # unchanged, and not yet due
        await ticks_pass()
        assert len(sent) == 1
        await nc.publish(subj.inventory_request("n9"), b"")
        await eventually(lambda: len(sent) >= 2, every=0.01, what="an inventory sent on request")
        now[0] += 600.0  # due again: the interval is kept without being asked
        await eventually(lambda: len(sent) >= 3, every=0.01, what="an inventory sent after the interval")
    finally:
        stop.set()
        await agent
