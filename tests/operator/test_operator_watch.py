"""A watched model whose engine is killed: one `model.down`, then one `model.recovered` (issue 7).

Every part is a real process: nats-server, control plane, router, notifier, two agents with simulated
engines. A real aiohttp receiver on 127.0.0.1 is set as the cluster's webhook. The engine of the only
replica of a watched model is SIGKILLed (its process group, PID from the agent's heartbeat): the
control plane sees no ready replica and the notifier's probes fail, so both may say the model is down;
the operator must get exactly one `model.down` and, once the replica is replaced, one `model.recovered`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from aiohttp import web
from nats.js.api import ConsumerInfo

from llmgw_common.messages import ClusterSettings, Event, Webhook
from llmgw_notifier.delivery import consumer_name
from llmgw_notifier.targets import target_id
from tests.chaos.chaos_bus import BUS_ERRORS, BusView, timed
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster
from tests.chaos.chaos_traffic import wait_serving
from tests.chaos.chaos_waits import mint_key, wait_endpoints
from tests.kit.poll import eventually

pytestmark = [pytest.mark.xdist_group("operator"), pytest.mark.e2e, pytest.mark.slow]

# The replacement takes 5 s to start, so the outage outlasts two failed probes (probe_every 2 s):
# both the control plane and the probes have reason to call it down.
CATALOG = """\
models:
  - name: judge
    engine: vllm
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: 1
    startup_timeout_s: 30
    watch: {probe_every: 2s, budget: 1s, failures: 2}
    options: {startup_s: 5.0, ttft_ms: 10, tokens_per_s: 500, slots: 16}
"""


class Receiver:
    """A generic-JSON webhook receiver that records every POST (and the event id header)."""

    def __init__(self) -> None:
        self.got: list[tuple[float, str | None, dict[str, Any]]] = []
        self.changed = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.got.append((time.monotonic(), request.headers.get("X-Llmgw-Event-Id"), body))
        self.changed.set()
        return web.Response(status=204)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/hook"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def events(self) -> list[dict[str, Any]]:
        """Every event received, flattened out of grouped messages."""
        out: list[dict[str, Any]] = []
        for _, _, body in self.got:
            out.extend(body["events"] if "events" in body else [body])
        return out

    def kinds(self, model: str) -> list[str]:
        return [
            e["kind"] for e in self.events() if e.get("subject") == model and e["kind"].startswith("model.")
        ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChaosCluster, str]]:
    c = ChaosCluster(Path(tmp_path_factory.mktemp("operator-watch")), prefix="watch", catalog=CATALOG)
    c.settings = {**AGGRESSIVE, "LLMGW_BACKOFF_BASE_S": "0.5", "LLMGW_GROUP_WINDOW_S": "0.5"}
    try:
        c.start_nats()
        c.start_controlplane()
        c.start_router()
        for n in ("n1", "n2"):
            c.start_agent(n)
        key = mint_key(c)
        probe_key = mint_key(c, "probes")
        c._proc(
            "notifier",
            ["notifier", "--router-url", c.router_url(), "--probe-key", probe_key, "--group-window", "0.5"],
            {},
        )
        c.wait_router()
        wait_endpoints(c, "judge", 1, 60)
        yield c, key
    finally:
        c.close()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver()
    await r.start()
    yield r
    await r.stop()


async def test_killed_engine_of_watched_model_alerts_once_down_once_recovered(
    cluster: tuple[ChaosCluster, str], receiver: Receiver
) -> None:
    c, key = cluster
    view = await BusView.connect(c.nats_url, c.prefix)
    consumer = consumer_name(c.prefix, target_id(receiver.url))
    try:
        await wait_serving(c.router_url(), key, "judge")
        # Probes failed while the first replica started: a model that was never up is not down.
        assert await view.model_events("judge") == [], "an alert while the first replica started"
        await view.ctl.settings_set(ClusterSettings(webhooks=(Webhook(url=receiver.url, format="json"),)))
        await eventually(
            lambda: _consumer_idle(view, consumer),
            timeout=20,
            every=0.2,
            what="the notifier to have delivered everything to the receiver",
            tolerate=BUS_ERRORS,
        )
        assert receiver.kinds("judge") == [], receiver.got
        pids = await eventually(
            lambda: _pids(view), timeout=15, every=0.2, what="judge's engine pid", tolerate=BUS_ERRORS
        )
        (pid,) = pids
        t_kill = time.monotonic()
        os.killpg(pid, signal.SIGKILL)

        async def down_and_up() -> list[str] | None:
            k = receiver.kinds("judge")
            return k if "model.recovered" in k else None

        kinds, took = await timed("model.down then model.recovered at the receiver", down_and_up, 60)
        # Every source that said down has said recovered, and the notifier has decided on all of it:
        # nothing is still in flight.
        stream = await eventually(
            lambda: _settled(view, "judge"),
            timeout=30,
            every=0.2,
            what="every source's recovery in the stream",
            tolerate=BUS_ERRORS,
        )
        assert stream is not None
        await eventually(
            lambda: _consumer_idle(view, consumer),
            timeout=20,
            every=0.2,
            what="the notifier to have decided on the whole stream",
            tolerate=BUS_ERRORS,
        )
        kinds = receiver.kinds("judge")
        ids = [eid for _, eid, _ in receiver.got]
        evs = [e for e in receiver.events() if e.get("subject") == "judge"]
        said = [(e.kind, e.details.get("source", "controlplane")) for e in stream]
        report = (
            f"watched model: engine {pid} killed; receiver got {kinds} ({len(receiver.got)} POSTs) "
            f"within {took:.1f}s; the stream held {said}"
        )
        print(report)
        assert len(set(ids)) == len(ids), f"an event id arrived twice: {ids}"
        assert kinds == ["model.down", "model.recovered"], report
        down, recovered = evs
        sources = sorted({src for kind, src in said if kind == "model.down"})
        assert down["details"]["sources"] == [said[0][1]], report  # the first to say it
        assert sorted(recovered["details"]["sources"]) == sources, report
        assert recovered["details"]["down_id"] == down["id"]
        new_pids = await eventually(
            lambda: _pids(view), timeout=15, every=0.2, what="judge to be served again", tolerate=BUS_ERRORS
        )
        assert pid not in new_pids
        assert time.monotonic() - t_kill < 60
    finally:
        await view.close()


async def _settled(view: BusView, model: str) -> list[Event] | None:
    """The model's events once every source that said down has said recovered (None before)."""
    evs = await view.model_events(model)
    open_sources: set[str] = set()
    for e in evs:
        src = e.details.get("source", "controlplane")
        (open_sources.add if e.kind == "model.down" else open_sources.discard)(src)
    return evs if evs and not open_sources else None


async def _consumer_idle(view: BusView, name: str) -> bool:
    """The target's consumer exists and has nothing undelivered or unacknowledged."""
    try:
        # nats-py leaves consumer_info unannotated; it returns a ConsumerInfo.
        info: ConsumerInfo = await view.nc.jetstream().consumer_info(view.subjects.events_stream, name)
    except nats.js.errors.NotFoundError:
        return False
    return info.num_pending == 0 and info.num_ack_pending == 0


async def _pids(view: BusView) -> set[int]:
    return set(view.engine_pids().values())
