"""Replicas that follow the load, with real processes (issue 21): a nats-server, the control plane, a
router and an agent with simulated engines. A load step takes the model 1 -> 3 and its end 3 -> 1, with
no failed request and no stream cut by a replica stopped under it (``failover: false``, every stream
checked against the engine's uninterrupted answer)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_common.event_details import ModelScaledDownDetails, ModelScaledUpDetails
from tests.chaos.chaos_bus import BusView
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster
from tests.chaos.chaos_traffic import Traffic
from tests.chaos.chaos_waits import mint_key, wait_endpoints
from tests.kit.poll import eventually

pytestmark = [pytest.mark.xdist_group("chaos"), pytest.mark.e2e, pytest.mark.slow]

# Two slots per replica: 6 streams in flight on 1 replica against a target of 2 per replica asks for 3.
# up_after spans ~15 answers: closed-loop clients that just joined look like a growing queue (more
# arrived than finished) only for the first few, and a growing queue is sized by its rates.
CATALOG = """\
models:
  - name: chat
    engine: sim
    gpu_class: H100-80GB
    replicas: 1
    max_replicas: 3
    target: {in_flight_per_replica: 2}
    up_after: 6s
    down_after: 6s
    failover: false
    startup_timeout_s: 60
    options: {startup_s: 1.0, ttft_ms: 20, tokens_per_s: 60, slots: 2}
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ChaosCluster, str]]:
    c = ChaosCluster(tmp_path, settings=dict(AGGRESSIVE), catalog=CATALOG)
    try:
        c.start_nats()
        c.start_controlplane()
        c.start_router()
        c.start_agent("n1", gpus="4xH100-80GB")
        key = mint_key(c)
        c.wait_router()
        wait_endpoints(c, "chat", 1, timeout=60)
        yield c, key
    finally:
        c.close()


async def test_a_load_step_scales_1_to_3_and_back_to_1_with_no_failed_request(
    cluster: tuple[ChaosCluster, str],
) -> None:
    c, key = cluster
    view = await BusView.connect(c.nats_url, c.prefix)
    # Back to back (no pause): the load in flight is what the autoscaler follows.
    base = Traffic(
        c.router_url(), key, clients=1, max_tokens=24, timeout_s=60, verify=True, pause_s=0
    ).start()
    burst = Traffic(c.router_url(), key, clients=5, max_tokens=24, timeout_s=60, verify=True, pause_s=0)
    try:
        # The base load (1 in flight, target 2 per replica) keeps 1 replica.
        await base.run_for(4.0)
        recs = await view.records()
        assert [r.model for r in recs.values()] == ["chat"], recs

        async def serving(n: int) -> bool:
            ep = await view.endpoints()
            return ep is not None and len(ep.endpoints.get("chat", ())) == n

        t_step = time.monotonic()
        burst.start()
        await eventually(lambda: serving(3), timeout=90, what="3 replicas of chat serving under the step")
        t_three = time.monotonic()
        await burst.run_for(4.0)
        await burst.stop()
        # The step is over: 1 in flight on 3 replicas is under the target with one fewer; two steps
        # down (down_after each), each replica drained, not stopped under a stream.
        await eventually(lambda: serving(1), timeout=120, what="chat back to 1 serving replica")

        async def one_record() -> bool:
            return len(await view.records()) == 1

        await eventually(one_record, timeout=60, what="the drained replicas stopped")
        await base.run_for(2.0)
    finally:
        await base.stop()
        if burst._tasks:
            await burst.stop()
        kinds = await view.model_events("chat")
        await view.close()
    failed = base.all("base").failed + burst.all("burst").failed
    assert failed == [], [base.all("base").line(), burst.all("burst").line()]
    assert len(burst.records) > 10 and len(base.records) > 10
    ups = [ModelScaledUpDetails.of(e) for e in kinds if e.kind == ModelScaledUpDetails.KIND]
    downs = [ModelScaledDownDetails.of(e) for e in kinds if e.kind == ModelScaledDownDetails.KIND]
    # One step up by the whole excess (not one at a time), then one replica at a time down.
    assert [(u.replicas_from, u.replicas_to) for u in ups] == [(1, 3)], ups
    assert [(d.replicas_from, d.replicas_to) for d in downs] == [(3, 2), (2, 1)], downs
    print(f"1 -> 3 serving {t_three - t_step:.1f}s after the step")
