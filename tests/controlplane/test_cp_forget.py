"""A silent node with nothing on it leaves ctl's node table after node_forget_s, said in one log line."""

from __future__ import annotations

import logging

import pytest
from nats.aio.client import Client as NATS

from llmgw_runtime.ctl_client import CtlClient
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, ctl_answers, start_cp
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually


@pytest.mark.slow
async def test_lost_node_is_forgotten_and_ctl_stops_listing_it(
    nats_server: NatsServer, prefix: str, bus_nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    # No catalog: nothing is placed, so the silent node holds no replica.
    run = await start_cp(cp_settings(nats_server.url, prefix, node_forget_s=1.5), catalog_text=None)
    c = CtlClient(bus_nc, prefix)
    alive, gone = FakeAgent(bus_nc, prefix, "alive"), FakeAgent(bus_nc, prefix, "gone")
    beating = Beating([alive], 0.1)
    try:
        with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
            await alive.send_inventory()
            await gone.send_inventory()
            beating.start()

            async def names() -> set[str]:
                return {n.name for n in (await c.nodes()).nodes} if run.cp.leader else set()

            async def both() -> bool:
                return await names() == {"alive", "gone"}

            async def only_alive() -> bool:
                return await names() == {"alive"}

            async def announced_lost() -> bool:
                rec, _ = await run.cp.loop.announced.read()
                return rec is not None and "gone" in rec.lost

            await ctl_answers(bus_nc, prefix)
            await eventually(both, what="ctl to list both nodes")
            # Lost after 1.5 s and announced so: seen here, within the 1.5 s before it is forgotten (the
            # wait for its leaving the announced state below passes too had it never been announced).
            await eventually(announced_lost, what="the silent node to be announced lost")
            await eventually(only_alive, what="ctl to list only the node still beating")
            assert "gone" not in run.cp.state.nodes

            async def not_announced_lost() -> bool:
                rec, _ = await run.cp.loop.announced.read()
                return rec is not None and "gone" not in rec.lost

            # Then dropped from the announced state without a node.recovered: if it ever reports again
            # it is a new node.
            await eventually(not_announced_lost, what="the forgotten node to leave the announced state")
        # The control plane's own lines: asyncio's slow-step warning names this test, "forgotten" and all.
        said = [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("llmgw.") and "forgotten" in r.getMessage()
        ]
        assert said == ["node gone forgotten: lost for over 1.5s with no replica on it"]
    finally:
        await beating.stop()
        await run.stop()
