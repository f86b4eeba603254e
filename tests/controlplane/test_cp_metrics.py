"""The control plane's Prometheus metrics: read from the running parts at scrape time, one registry per
control plane, served at /metrics on the admin listener."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.messages import ShardState
from llmgw_controlplane.admin import CtlApiSource, build_admin_app
from llmgw_controlplane.metrics import add_metrics_route
from llmgw_controlplane.service import ControlPlane, serve
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import free_port
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually
from tests.kit.promtext import value

CATALOG = """
models:
  - name: small
    engine: sim
    replicas: 1
    gpu_class: H100-80GB
    watch: {budget: 0.5s, probe_every: 5s}
  - name: nowhere
    engine: sim
    replicas: 1
    gpu_class: B200
"""


def scrape(cp: ControlPlane) -> bytes:
    return cp.metrics.exposition()


def replicas(cp: ControlPlane, phase: str) -> float | None:
    return value(scrape(cp), "llmgw_controlplane_replicas", phase=phase)


@pytest.mark.slow
async def test_metrics_follow_passes_phases_nodes_lease_and_unplaceable(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix), CATALOG, holder="cp-a")
    standby = await start_cp(cp_settings(nats_server.url, prefix), CATALOG, holder="cp-b")
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    beating = Beating([agent], 0.1)
    cp = run.cp
    try:
        await agent.send_inventory()
        beating.start()
        # Replicas are written mid-pass, verdicts and counts later: wait for the pass to have ended.
        await eventually(
            lambda: (
                replicas(cp, "starting") == 1
                and value(scrape(cp), "llmgw_controlplane_unplaceable_models") == 1
                and (value(scrape(cp), "llmgw_controlplane_reconcile_passes_total") or 0) >= 1
            ),
            what="one replica starting, one model unplaceable",
        )
        text = scrape(cp)
        assert value(text, "llmgw_controlplane_leader") == 1
        assert value(text, "llmgw_controlplane_lease_fence") == cp.fence > 0
        assert value(text, "llmgw_controlplane_nodes", health="ready") == 1
        assert value(text, "llmgw_controlplane_nodes", health="lost") == 0
        assert value(text, "llmgw_controlplane_replicas", phase="ready") == 0
        # B200 exists nowhere: "nowhere" cannot be placed.
        assert set(cp.verdicts.unplaceable) == {"nowhere"}
        passes = value(text, "llmgw_controlplane_reconcile_passes_total")
        assert passes is not None and passes >= 1
        # The histogram is fed by the same passes the counter counts (both in one synchronous step).
        assert value(text, "llmgw_controlplane_reconcile_pass_seconds_count") == passes
        assert value(text, "llmgw_controlplane_reconcile_failed_passes_total") == 0
        # Why passes were asked for early: this tenure's start, and the agent's reports; every reason is
        # exported, 0 when never asked (no bus loss here).
        assert value(text, "llmgw_controlplane_pass_requests_total", reason="tenure") == 1
        assert (value(text, "llmgw_controlplane_pass_requests_total", reason="report") or 0) >= 1
        assert value(text, "llmgw_controlplane_pass_requests_total", reason="bus_back") == 0

        rid = next(iter(cp.state.replicas))  # the one placed: "small"
        await agent.report(rid, 0, "small", ShardState.READY, 20000)
        await eventually(lambda: replicas(cp, "ready") == 1, what="the replica ready in the metrics")
        assert replicas(cp, "starting") == 0
        assert value(scrape(cp), "llmgw_controlplane_models_down") == 0

        # The standby: its own registry, its own lease state, no verdicts of a pass it did not make.
        st = scrape(standby.cp)
        assert value(st, "llmgw_controlplane_leader") == 0
        assert value(st, "llmgw_controlplane_unplaceable_models") is None
        assert value(st, "llmgw_controlplane_models_down") is None
        assert value(st, "llmgw_controlplane_reconcile_passes_total") == 0

        await beating.stop()
        await eventually(
            lambda: value(scrape(cp), "llmgw_controlplane_nodes", health="lost") == 1,
            what="the silent node lost in the metrics",
        )
        # "small" is watched: with its only node silent it has no ready replica, and is down.
        await eventually(
            lambda: value(scrape(cp), "llmgw_controlplane_models_down") == 1, what="the watched model down"
        )
    finally:
        await beating.stop()
        await standby.stop()
        await run.stop()


async def test_a_failed_pass_is_counted(nats_server: NatsServer, prefix: str) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix), CATALOG)
    try:
        await eventually(lambda: run.cp.passes > 0, what="a first pass")
        run.cp.guard.failure(RuntimeError("a pass raised"))
        assert value(scrape(run.cp), "llmgw_controlplane_reconcile_failed_passes_total") == 1
    finally:
        await run.stop()


async def test_metrics_are_served_on_the_admin_app(nats_server: NatsServer, prefix: str) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix), CATALOG)
    try:
        await eventually(lambda: run.cp.passes > 0, what="a first pass")
        app = build_admin_app(CtlApiSource(run.cp.api, run.cp.usage))
        add_metrics_route(app, run.cp.metrics)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8081") as http:
            r = await http.get("/metrics")
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/plain; version=")
            assert value(r.text, "llmgw_controlplane_leader") == 1
            # The console's loopback guard covers it like every admin page.
            far = await http.get("/metrics", headers={"host": "cp.example.com"})
            assert far.status_code == 400
    finally:
        await run.stop()


@pytest.mark.slow
async def test_serve_answers_metrics_on_its_admin_port(nats_server: NatsServer, prefix: str) -> None:
    port = free_port()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cp_settings(nats_server.url, prefix, admin_port=port), stop))

    async def scraped() -> str | None:
        async with httpx.AsyncClient() as http:
            try:
                r = await http.get(f"http://127.0.0.1:{port}/metrics")
            except httpx.ConnectError:
                return None
        return r.text if r.status_code == 200 and "llmgw_controlplane_leader 1.0" in r.text else None

    try:
        text = await eventually(scraped, timeout=20, what="the control plane's /metrics, leading")
        assert text is not None
        assert value(text, "llmgw_controlplane_nodes", health="ready") == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
