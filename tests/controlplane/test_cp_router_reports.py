"""Routers' idle and usage reports on the real bus: a report speaks only for the router of its subject.

The router role may publish on every router's idle and usage subjects, so the id inside a report is the
publisher's claim: one naming another router (or a name no subject can carry, of any length) is dropped
with one line, never kept as a router of its own.
"""

from __future__ import annotations

import time

from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.router_messages import IdleReport, UsageReport
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.kit.poll import eventually


async def test_a_report_naming_another_router_than_its_subject_is_dropped(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix), catalog_text=None)
    cp = run.cp
    subj = Subjects(prefix)
    now = time.time()
    huge = "r" * 100_000

    def idle(router: str) -> bytes:
        return encode(
            IdleReport.model_construct(router=router, since=now, sent_at=now, last_used={}, breakers={})
        )

    def usage(router: str) -> bytes:
        return encode(UsageReport.model_construct(router=router, since=now, sent_at=now, usage={}))

    try:
        drops = cp.drops.count
        for make, subject in ((idle, subj.idle), (usage, subj.usage)):
            await bus_nc.publish(subject("r1"), make("r2"))  # speaks for r2 on r1's subject
            await bus_nc.publish(subject("r1"), make(huge))  # a name no subject carries
            await bus_nc.publish(subject("r1"), make("r1"))  # genuine: the sync point
        await bus.flush(bus_nc)

        def heard() -> bool:
            return cp.idle.routers == ("r1",) or len(cp.idle.routers) > 1

        await eventually(heard, what="r1's idle report heard")
        await eventually(lambda: cp.usage.view().routers >= 1, what="r1's usage report heard")
        assert cp.idle.routers == ("r1",)
        assert cp.usage.view().routers == 1
        assert cp.drops.count - drops == 4
    finally:
        await run.stop()
