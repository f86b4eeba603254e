"""An agent restart on a node whose replica has been up longer than its startup timeout.

The real thing takes 700 s with the default ``startup_timeout_s`` of 600; here the timeout is a few
seconds, and the replica is older than it when the agent is killed. The restarted agent re-adopts the
engine; the control plane must keep the replica (same record, same engine PID) and say nothing, and the
routers must never lose its endpoint (the model is watched and has a single replica: a gap would be a
model.down and a model.recovered).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from nats.aio.msg import Msg

from tests.chaos.chaos_bus import BUS_ERRORS, BusView, EndpointRevisions, timed
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster, boot
from tests.kit.poll import eventually

pytestmark = [pytest.mark.xdist_group("chaos"), pytest.mark.e2e, pytest.mark.slow]

STARTUP_TIMEOUT_S = 4.0
CATALOG = f"""\
models:
  - name: chat
    engine: vllm
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: 1
    startup_timeout_s: {STARTUP_TIMEOUT_S:g}
    watch: {{probe_every: 30s, budget: 20s}}
    options: {{startup_s: 0.3, ttft_ms: 15, tokens_per_s: 300, slots: 64}}
"""
# An agent restart must not look like a lost node either.
SETTINGS = {**AGGRESSIVE, "LLMGW_NODE_LOST_S": "20"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosCluster]:
    c, _ = boot(
        Path(tmp_path_factory.mktemp("chaos-uptime")),
        nodes=("n1",),
        replicas=1,
        settings=SETTINGS,
        catalog=CATALOG,
    )
    yield c
    c.close()


async def test_agent_restart_after_the_startup_timeout_keeps_the_readopted_replica(
    cluster: ChaosCluster,
) -> None:
    c = cluster
    view = await BusView.connect(c.nats_url, c.prefix)
    events: list[str] = []

    async def on_event(msg: Msg) -> None:
        events.append(msg.subject)

    sub = await view.nc.subscribe(view.subjects.all_events(), cb=on_event)
    try:
        before = await eventually(
            lambda: _pids(view),
            timeout=30,
            every=0.2,
            what="n1 to report its engine ready",
            tolerate=BUS_ERRORS,
        )
        assert before is not None
        records = await view.records()
        (rec,) = records.values()
        # Older than its startup timeout by the control plane's clock (records carry its time).
        await eventually(
            lambda: time.time() > rec.created + STARTUP_TIMEOUT_S + 1,
            timeout=STARTUP_TIMEOUT_S + 10,
            every=0.2,
            what="the replica to outlive its startup timeout",
        )
        old_boot = view.heartbeats["n1"].boot_id
        revisions = await EndpointRevisions.follow(view, "chat")
        c.procs["agent-n1"].kill()  # its engines live in groups of their own and keep running
        c.start_agent("n1")

        async def readopted() -> dict[tuple[str, int], int] | None:
            hb = view.heartbeats.get("n1")
            return view.engine_pids("n1") or None if hb is not None and hb.boot_id != old_boot else None

        after, took = await timed("the new agent to report the engine ready", readopted, 40)
        # The control plane has judged the replica many times since then.
        stats = await eventually(
            view.stats, timeout=10, every=0.2, what="the control plane's stats", tolerate=BUS_ERRORS
        )
        assert stats is not None
        passes = stats.passes
        await eventually(
            lambda: _passes_past(view, passes + 20),
            timeout=30,
            every=0.2,
            what="20 more reconcile passes",
            tolerate=BUS_ERRORS,
        )
        await revisions.stop()
        report = (
            f"engines {before} -> {after} (ready again {took:.1f}s after the restart); events {events}; "
            f"endpoints per revision {revisions.seen}"
        )
        # Every revision the routers were given across the restart still lists the replica.
        assert revisions.seen and all(ids == (rec.id,) for ids in revisions.seen), report
        assert view.engine_pids("n1") == before, report
        assert all(psutil.pid_exists(p) for p in before.values()), report
        assert await view.records() == records, report  # not failed, not replaced
        assert events == [], report
        assert "re-adopting" in c.procs["agent-n1"].tail(200)
    finally:
        await sub.unsubscribe()
        await view.close()


async def _pids(view: BusView) -> dict[tuple[str, int], int] | None:
    return view.engine_pids("n1") or None


async def _passes_past(view: BusView, n: int) -> bool:
    s = await view.stats()
    return s is not None and s.passes >= n
