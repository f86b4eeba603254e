"""A replica with a request in flight is never evicted (issue 14: nothing a client sees fails).

A replica of a model with one replica that is stopped under a stream cuts the stream: there is nowhere
to continue it. Recently used is not enough to keep a replica (two models sharing one card must swap
under alternating traffic); being in use right now is. Real nats-server, control plane in-process, a
fake agent and a fake router publishing real reports.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.router_messages import IdleReport, WakeState
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.controlplane.test_cp_wake import CATALOG, Router, endpoints, events, ready_all, replicas_of, wake
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually


class StreamingRouter(Router):
    """Reports ``streaming`` as in flight: a request on each, right now."""

    def __init__(self, nc: NATS, prefix: str) -> None:
        super().__init__(nc, prefix)
        self.streaming: set[str] = set()

    async def _run(self) -> None:
        while True:
            self.used.update({r: time.time() for r in self.busy | self.streaming})
            rep = IdleReport(
                router=self.router,
                since=self.since,
                sent_at=time.time(),
                last_used=dict(self.used),
                in_flight=sorted(self.streaming),
            )
            await self.nc.publish(self.subjects.idle(self.router), encode(rep))
            await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_a_replica_serving_a_request_is_not_evicted_until_it_is_done(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix, eviction_min_residency_s=0.0), CATALOG)
    agent = FakeAgent(bus_nc, prefix, "n1", gpus=1, memory_gb=None)
    beating = Beating([agent], 0.1)
    router = StreamingRouter(bus_nc, prefix)
    try:
        await agent.send_inventory()
        beating.start()
        await eventually(lambda: endpoints(bus_nc, prefix), what="routing endpoints published")
        assert (await wake(bus_nc, prefix, "a")).state is WakeState.WAKING
        await eventually(lambda: replicas_of(run.cp, "a"), what="a replica of a placed")
        (a_id,) = replicas_of(run.cp, "a")
        await ready_all(run.cp, agent)
        router.streaming.add(a_id)
        router.start()
        await eventually(lambda: run.cp.idle.routers, what="the router's idle report heard")

        reply = await wake(bus_nc, prefix, "b")
        assert reply.state is WakeState.WAKING, reply
        assert f"{a_id}: serving a request right now" in reply.reason, reply.reason
        for _ in range(3):
            await run.cp.loop.pass_once(time.time())
        assert replicas_of(run.cp, "a") == [a_id] and replicas_of(run.cp, "b") == []
        assert await events(bus_nc, prefix, "model.evicted") == []

        # The stream ends: now a, known idle, makes room for b.
        router.streaming.clear()
        evicted = await eventually(
            lambda: events(bus_nc, prefix, "model.evicted"), what="a model.evicted event"
        )
        assert [e.details["replica"] for e in evicted] == [a_id]
    finally:
        await router.stop()
        await beating.stop()
        await run.stop()
