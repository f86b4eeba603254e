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

import pytest
from aiohttp import web
from chaos_bus import BusView, poll
from chaos_harness import AGGRESSIVE, ChaosCluster, mint_key, wait_endpoints
from chaos_traffic import wait_serving

from llmgw_common.messages import ClusterSettings, Webhook

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
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
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


@pytest.mark.xfail(
    strict=True,
    reason="known: the control plane (no ready replica) and the notifier's probes (not answering) each "
    "deliver a model.down and a model.recovered for one outage; the receiver gets 2+2, not 1+1",
)
async def test_killed_engine_of_watched_model_alerts_once_down_once_recovered(
    cluster: tuple[ChaosCluster, str], receiver: Receiver
) -> None:
    c, key = cluster
    view = await BusView.connect(c.nats_url, c.prefix)
    try:
        await wait_serving(c.router_url(), key, "judge")
        # Probes that failed while the first replica started call the model down (known: see the
        # operator report); let that settle before the receiver is configured, so only the kill counts.
        await asyncio.sleep(5.0)
        await view.ctl.settings_set(ClusterSettings(webhooks=(Webhook(url=receiver.url, format="json"),)))
        # A few probes succeed: nothing is said while the model answers.
        await asyncio.sleep(3.0)
        assert receiver.kinds("judge") == [], receiver.got
        pids, _ = await poll("judge's engine pid", lambda: _pids(view), 15)
        (pid,) = pids
        t_kill = time.monotonic()
        os.killpg(pid, signal.SIGKILL)

        async def down_and_up() -> list[str] | None:
            k = receiver.kinds("judge")
            return k if "model.recovered" in k else None

        kinds, took = await poll("model.down then model.recovered at the receiver", down_and_up, 60)
        # Anything else still in flight (a second source's down or recovered) arrives now or never.
        await asyncio.sleep(5.0)
        kinds = receiver.kinds("judge")
        ids = [eid for _, eid, _ in receiver.got]
        evs = [e for e in receiver.events() if e.get("subject") == "judge"]
        report = (
            f"watched model: engine {pid} killed; receiver got {kinds} ({len(receiver.got)} POSTs) "
            f"within {took:.1f}s; sources {[e.get('details', {}).get('source', 'controlplane') for e in evs]}"
        )
        print(report)
        assert len(set(ids)) == len(ids), f"an event id arrived twice: {ids}"
        assert kinds == ["model.down", "model.recovered"], report
        new_pids, _ = await poll("judge serving again", lambda: _pids(view), 15)
        assert pid not in new_pids
        assert time.monotonic() - t_kill < 60
    finally:
        await view.close()


async def _pids(view: BusView) -> set[int] | None:
    return set(view.engine_pids().values()) or None
