"""A heartbeat or inventory whose node name carries control characters is dropped by the real control
plane with one log line that shows them escaped; the node never enters its tables (issue 11)."""

from __future__ import annotations

import logging
import time

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.messages import Heartbeat, Inventory
from llmgw_common.subjects import Subjects
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.kit.agents import FakeAgent
from tests.kit.poll import eventually

EVIL = "evil\x1b[2J\x1b]8;;https://x\x07"


async def test_node_with_control_characters_is_dropped_with_one_escaped_line(
    nats_server: NatsServer, prefix: str, bus_nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmgw")
    run = await start_cp(cp_settings(nats_server.url, prefix))
    sub = Subjects(prefix)
    try:
        before = run.cp.drops.count
        hb = Heartbeat.model_construct(node=EVIL, boot_id="b", seq=1, sent_at=time.time(), shards=())
        inv = Inventory.model_construct(node=EVIL, boot_id="b", sent_at=time.time())
        await bus_nc.publish(sub.heartbeat(EVIL), encode(hb))
        await bus_nc.publish(sub.inventory(EVIL), encode(inv))
        # A good node after them, on the same subscriptions: once it is in, the bad ones were handled.
        good = FakeAgent(bus_nc, prefix, "n1")
        await good.send_inventory()
        await good.beat()

        def n1_known() -> bool:
            rec = run.cp.state.nodes.get("n1")
            return rec is not None and rec.inventory is not None

        await eventually(n1_known, what="n1's inventory, sent after the bad ones, taken")
        assert run.cp.drops.count - before == 2
        assert EVIL not in run.cp.state.nodes
        lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(lines) == 2, lines
        for line in lines:
            assert "\x1b" not in line and "\x07" not in line, repr(line)
            assert "evil\\x1b[2J" in line and "node name" in line
    finally:
        await run.stop()
