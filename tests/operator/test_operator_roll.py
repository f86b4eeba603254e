"""A profile change under traffic drops nothing (issue 12 item 14), with every part a real process.

nats-server, a control plane, a router and two agents with simulated GPUs and engines; one model with two
replicas. Clients send requests without pause while `llmgw ctl catalog apply` changes the model's engine
options. The replicas must be replaced one at a time (never more than one extra replica), every response
must be a 200, and every old engine must be gone at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import psutil
import pytest

from llmgw_common.catalog import parse_catalog
from llmgw_common.messages import ReplicaSpec
from tests.chaos.chaos_bus import BUS_ERRORS, BusView, timed
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster
from tests.chaos.chaos_traffic import wait_serving
from tests.chaos.chaos_waits import mint_key, wait_endpoints
from tests.kit.poll import eventually
from tests.operator.test_operator_drain import MixedTraffic, _ctl

pytestmark = [pytest.mark.xdist_group("operator"), pytest.mark.e2e, pytest.mark.slow]

CATALOG = """\
models:
  - name: chat
    engine: vllm
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: 2
    startup_timeout_s: 30
    options: {startup_s: 1.0, ttft_ms: 20, tokens_per_s: 100, slots: 64}
"""
CHANGED = CATALOG.replace("tokens_per_s: 100", "tokens_per_s: 120")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChaosCluster, str]]:
    c = ChaosCluster(Path(tmp_path_factory.mktemp("operator-roll")), prefix="roll", catalog=CATALOG)
    c.settings = {**AGGRESSIVE, "LLMGW_STOP_GRACE_S": "10"}
    try:
        c.start_nats()
        c.start_controlplane()
        c.start_router()
        for n in ("n1", "n2"):
            c.start_agent(n)
        key = mint_key(c)
        c.wait_router()
        wait_endpoints(c, "chat", 2, 60)
        yield c, key
    finally:
        c.close()


async def test_profile_change_under_traffic_rolls_one_at_a_time_and_drops_nothing(
    cluster: tuple[ChaosCluster, str],
) -> None:
    c, key = cluster
    view = await BusView.connect(c.nats_url, c.prefix)
    traffic = MixedTraffic(c.router_url(), key, clients=4, max_tokens=40)
    new_spec = ReplicaSpec.of(parse_catalog(CHANGED).models[0])
    most = 0
    # The fewest endpoints routers were told they may send new requests to (not flagged draining):
    # an old replica keeps taking requests until its replacement serves (#8), so never below 2.
    fewest_routed: int | None = None
    watching = True

    async def count_records() -> None:
        nonlocal most, fewest_routed
        while watching:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                most = max(most, len(await view.records()))
                routing = await view.endpoints()
                if routing is not None:
                    routed = sum(1 for e in routing.endpoints.get("chat", ()) if not e.draining)
                    fewest_routed = routed if fewest_routed is None else min(fewest_routed, routed)
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(count_records())
    try:
        await wait_serving(c.router_url(), key)
        old_ids = set(await view.records())
        old_pids = await eventually(
            lambda: _two(set(view.engine_pids().values())),
            timeout=15,
            every=0.2,
            what="both engines ready",
            tolerate=BUS_ERRORS,
        )
        assert old_pids is not None
        traffic.start()
        await traffic.run_for(2.0)
        t_apply = time.monotonic()
        path = c.root / "changed.yaml"
        path.write_text(CHANGED, encoding="utf-8")
        said = await _ctl(c, "catalog", "apply", str(path))
        assert "tokens_per_s" in said, said

        async def replaced() -> bool:
            # What a user sees: new engines serving both replicas, the old ones gone.
            pids = set(view.engine_pids().values())
            eps = await view.endpoint_nodes("chat")
            gone = not any(psutil.pid_exists(p) for p in old_pids)
            return gone and len(pids) == 2 and not pids & old_pids and len(eps) == 2

        _, took = await timed("both replicas replaced and serving, and the old engines gone", replaced, 90)
        await traffic.run_for(2.0)
        await traffic.stop()
        every = traffic.all("all requests")
        during = traffic.between(t_apply, t_apply + took, "started during the change")
        recs = await view.records()
        report = (
            f"profile change: both replicas replaced in {took:.1f}s, at most {most} records at once, "
            f"at least {fewest_routed} endpoints routed\n"
            f"  {every.line()}\n  {during.line()}\n  first failures: {[r.why for r in every.failed][:3]}"
        )
        print(report)
        assert not every.failed, report
        assert during.ok > 10, report
        assert most == 3, report  # one surge at a time, and there was one
        assert fewest_routed == 2, report  # never one replica short while a replacement starts
        # Replaced, not restarted in place: new replicas, started with the new profile.
        assert len(recs) == 2 and not old_ids & set(recs), recs
        assert all(r.spec == new_spec for r in recs.values()), recs
    finally:
        watching = False
        await watcher
        await traffic.stop()
        await view.close()


def _two(pids: set[int]) -> set[int] | None:
    return pids if len(pids) == 2 else None
