"""The signal replicas follow (issue 21): each router's demand summary, and the control plane hearing it
on the real bus (a report speaks only for the router of its subject)."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NATS

from llmgw_common.catalog import Catalog, LoadTarget, ModelProfile
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, LoadReport, ReplicaLoad, RoutingEndpoints
from llmgw_common.router_messages import DemandReport, ModelDemand
from llmgw_common.subjects import Subjects
from llmgw_router.context import Limits, RouterContext
from llmgw_router.demand import DemandMeter, p90_ms
from llmgw_router.routing.endpoints import Pool
from llmgw_router.tenancy.auth import Exemptions
from llmgw_router.tenancy.keys import KeyTable
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.kit.poll import eventually

T0 = 50_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _ctx(clock: Clock) -> RouterContext:
    pool = Pool()
    follows = ModelProfile(
        name="m", engine="sim", max_replicas=3, target=LoadTarget(waiting_per_replica=2), max_concurrency=1
    )
    pool.set_catalog(Catalog(models=(follows, ModelProfile(name="fixed", engine="sim"))))
    pool.set_endpoints(
        RoutingEndpoints(
            version=1,
            endpoints={
                "m": tuple(
                    Endpoint(replica_id=f"m-{i}", model="m", url=f"http://127.0.0.1:{9000 + i}", node="n1")
                    for i in range(2)
                )
            },
        )
    )
    return RouterContext(
        router_id="r1",
        pool=pool,
        keys=KeyTable(),
        auth=False,
        exemptions=Exemptions.parse([]),
        limits=Limits(load_stale_s=5.0),
        started=T0,
        clock=clock,
    )


async def test_a_router_summarises_what_it_holds_and_what_the_engines_said_unknown_kept_apart() -> None:
    clock = Clock()
    ctx = _ctx(clock)
    meter = DemandMeter(ctx, window_s=30.0)
    first = meter.report("r1", T0 + 1)
    # Only models that follow load; a router that holds no engine report knows nothing of the engines.
    assert set(first.models) == {"m"}
    d = first.models["m"]
    assert (d.in_flight, d.queued, d.held, d.replicas_reporting) == (0, 0, 0, 0)
    assert (d.running, d.waiting, d.kv_use, d.ttft_p90_ms) == (None, None, None, None)

    # One replica's load report; one request admitted (limit 1) and one queued behind it.
    ctx.pool.apply_load(
        LoadReport(
            node="n1", sent_at=T0 + 2, replicas=(ReplicaLoad(replica_id="m-0", running=3, waiting=5),)
        ),
        T0 + 2,
    )
    gate = ctx.gates.of(ctx.pool.profiles["m"])
    await gate.enter()
    queued = asyncio.create_task(gate.enter())
    await asyncio.sleep(0)
    for _ in range(9):
        ctx.metrics.first_byte("m", 0.3)
    ctx.metrics.first_byte("m", 4.0)
    d = meter.report("r1", T0 + 3).models["m"]
    assert (d.queued, d.replicas_reporting, d.running, d.waiting, d.kv_use) == (1, 1, 3, 5, None)
    # 9 of 10 within the 0.5 s bucket: the p90 is that bucket's bound.
    assert (d.ttft_p90_ms, d.ttft_samples) == (500.0, 10)

    # A stale load report is not believed; the window moves on past the old first bytes.
    ctx.metrics.first_byte("m", 0.002)
    d = meter.report("r1", T0 + 40).models["m"]
    assert (d.replicas_reporting, d.waiting) == (0, None)
    assert (d.ttft_samples, d.ttft_p90_ms, d.window_s) == (1, 2.5, 30.0)
    # Arrivals and completions over the model's up_after (15 s): one finished, one still queued.
    ctx.metrics.request("m", 200, 0.5)
    d = meter.report("r1", T0 + 41).models["m"]
    assert (d.completed, d.arrived, d.rate_s) == (1, 1, 38.0)
    gate.leave()
    await queued
    gate.leave()


def test_p90_is_a_bucket_bound_never_below_the_truth() -> None:
    assert p90_ms([0] * 15) is None
    counts = [0] * 15
    counts[14] = 1  # past the last bound (30 s)
    assert p90_ms(counts) == 30_000.0


async def test_the_control_plane_hears_demand_only_from_the_router_of_its_subject(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix), catalog_text=None)
    cp = run.cp
    subj = Subjects(prefix)
    now = time.time()

    def report(router: str, in_flight: int) -> bytes:
        return encode(
            DemandReport(
                router=router, since=now, sent_at=now, models={"m": ModelDemand(in_flight=in_flight)}
            )
        )

    try:
        drops = cp.drops.count
        await bus_nc.publish(subj.demand("r1"), report("r2", 100))  # speaks for r2 on r1's subject
        await bus_nc.publish(subj.demand("r1"), report("r1", 3))
        await bus.flush(bus_nc)
        await eventually(lambda: cp.demand.routers != (), what="r1's demand report heard")
        assert cp.demand.routers == ("r1",)
        assert cp.demand.merged(time.time())["m"].in_flight == 3
        assert cp.drops.count - drops == 1
    finally:
        await run.stop()
