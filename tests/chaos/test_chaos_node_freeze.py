"""A node that vanishes without closing its connections, under traffic: SIGSTOP its agent and engines.

Unlike a kill, nothing tells the router: the engines' connections stay open and silent. The control
plane declares the node lost when its heartbeats stop (``LLMGW_NODE_LOST_S``, 4 s here) and withdraws
its endpoints; the router then aborts the streams in flight to them, and each continues on the other
replica. No request fails (the clients give up after 20 s; the router's own timeouts are far longer).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.chaos_bus import BUS_ERRORS, BusView, timed
from tests.chaos.chaos_harness import STREAMING_CATALOG, ChaosCluster, boot
from tests.chaos.chaos_traffic import Traffic, streams_on, wait_serving
from tests.kit.poll import eventually

pytestmark = [pytest.mark.xdist_group("chaos"), pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChaosCluster, str]]:
    c, key = boot(Path(tmp_path_factory.mktemp("chaos-node-freeze")), catalog=STREAMING_CATALOG)
    yield c, key
    c.close()  # resumes stopped processes before it kills them


def _signal_node(cluster: ChaosCluster, engines: list[int], node: str, sig: signal.Signals) -> None:
    cluster.procs[f"agent-{node}"].signal(sig)
    for pid in engines:
        try:
            os.killpg(pid, sig)  # each engine leads its own process group
        except ProcessLookupError:
            pass


async def test_frozen_node_under_traffic(cluster: tuple[ChaosCluster, str]) -> None:
    c, key = cluster
    view = await BusView.connect(c.nats_url, c.prefix)
    traffic = Traffic(c.router_url(), key, clients=16, max_tokens=200, verify=True)
    victim, engines = "", []
    try:
        await wait_serving(c.router_url(), key)
        hosts = await eventually(
            lambda: _two(view.nodes_hosting("chat")),
            timeout=15,
            every=0.2,
            what="two nodes to host chat",
        )
        assert hosts is not None
        victim = sorted(hosts)[0]
        engines = sorted(set(view.engine_pids(victim).values()))
        assert engines, f"{victim} reported no engine"
        traffic.start()

        async def warm() -> float | None:
            if sum(1 for r in traffic.records if r.ok) < 8:
                return None
            running = await streams_on(view, "chat", victim)
            return running if running >= 4 else None

        await eventually(
            warm, timeout=60, every=0.2, what="four streams running on the victim", tolerate=BUS_ERRORS
        )
        t_freeze = time.monotonic()
        _signal_node(c, engines, victim, signal.SIGSTOP)

        async def withdrawn() -> list[str] | None:
            nodes = await view.endpoint_nodes("chat")
            return nodes if victim not in nodes else None

        _, took = await timed(f"{victim}'s endpoint to be withdrawn", withdrawn, 30)
        await traffic.run_for(3.0)
        await traffic.stop()
        flying = traffic.in_flight_at(t_freeze, "in flight at the freeze")
        after = traffic.started_after(t_freeze, "started after the freeze")
        log = c.procs["router"].log_path.read_text(errors="replace")
        migrations = log.count("continuing on")
        report = (
            f"node freeze: stopped {victim} (engines {engines}); endpoint withdrawn after {took:.1f}s\n"
            f"  {flying.line()}\n  {after.line()}\n  streams continued on another replica: {migrations}"
        )
        if flying.failed or traffic.all().failed:  # what the router said, for a failure seen once in a while
            report += "\n  the router's log, its end:\n    " + "\n    ".join(log.splitlines()[-40:])
        print(report)
        assert len(flying.records) >= 8, report
        assert not flying.failed, report
        assert not traffic.all().failed, report
        assert migrations > 0 and "withdrawn with" in log, report
    finally:
        await traffic.stop()
        await view.close()
        if victim:
            _signal_node(c, engines, victim, signal.SIGCONT)
            _signal_node(c, engines, victim, signal.SIGKILL)


def _two(hosts: set[str]) -> set[str] | None:
    return hosts if len(hosts) == 2 else None
