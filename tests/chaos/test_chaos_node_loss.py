"""Node loss under traffic: SIGKILL an agent and its engines while sixteen clients stream 200 tokens.

The lost node's replica is rebuilt on a survivor. No request fails: those that started after the kill
(the router retries a dead endpoint before the first byte, and the other replica serves meanwhile), and
those in flight on the killed node at the moment of the kill (the router continues each stream on the
other replica). Every stream's text is the uninterrupted answer (the simulator makes it checkable), with
one id, one finish_reason, one [DONE], and usage that adds up.
"""

from __future__ import annotations

import asyncio
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
    c, key = boot(Path(tmp_path_factory.mktemp("chaos-node-loss")), catalog=STREAMING_CATALOG)
    yield c, key
    c.close()


def kill_node(cluster: ChaosCluster, view: BusView, node: str) -> list[int]:
    """SIGKILL the node's agent and every engine group it reported: the node is gone at once."""
    engines = sorted(set(view.engine_pids(node).values()))
    cluster.procs[f"agent-{node}"].signal(signal.SIGKILL)
    for pid in engines:
        try:
            os.killpg(pid, signal.SIGKILL)  # each engine leads its own process group
        except ProcessLookupError:
            pass
    cluster.procs[f"agent-{node}"].kill()  # reap
    return engines


async def test_node_loss_under_traffic(cluster: tuple[ChaosCluster, str]) -> None:
    c, key = cluster
    view = await BusView.connect(c.nats_url, c.prefix)
    traffic = Traffic(c.router_url(), key, clients=16, max_tokens=200, verify=True)
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
        traffic.start()

        async def warm() -> float | None:
            # Streams finished before the kill (a loaded box makes a fixed wait too short), and streams
            # running on the victim (the router may have sent it nothing for a while).
            if sum(1 for r in traffic.records if r.ok) < 8:
                return None
            running = await streams_on(view, "chat", victim)
            return running if running >= 4 else None

        await eventually(
            warm, timeout=60, every=0.2, what="four streams running on the victim", tolerate=BUS_ERRORS
        )
        t_kill = time.monotonic()
        engines = kill_node(c, view, victim)
        assert engines, f"{victim} reported no engine to kill"

        async def rebuilt() -> list[str] | None:
            nodes = await view.endpoint_nodes("chat")
            return nodes if len(nodes) == 2 and victim not in nodes else None

        nodes, took = await timed(f"chat to be rebuilt away from {victim}", rebuilt, 40)
        await wait_serving(c.router_url(), key)
        await traffic.run_for(2.0)
        await traffic.stop()
        before = traffic.ended_before(t_kill, "finished before the kill")
        after = traffic.started_after(t_kill, "started after the kill")
        flying = traffic.in_flight_at(t_kill, "in flight at the kill")
        migrations = c.procs["router"].log_path.read_text(errors="replace").count("continuing on")
        gaps = sorted(r.gap for r in flying.records if r.gap_at <= t_kill + 1.0)
        report = (
            f"node loss: killed {victim} (engines {engines}); replacement serving after {took:.1f}s on "
            f"{sorted(nodes)}\n  {before.line()}\n  {flying.line()}\n  {after.line()}\n"
            f"  streams continued on another replica: {migrations}; longest pause of in-flight streams "
            f"{gaps[-1:] or '-'} s"
        )
        print(report)
        assert before.ok > 0, report
        assert after.ok > 0, report
        assert len(flying.records) >= 8, report
        assert not flying.failed, report
        assert not after.failed, report
        assert not traffic.all().failed, report
        assert migrations > 0, report
        assert sorted(set(nodes)) != [victim] and all(n != victim for n in nodes), report
        alive = await asyncio.to_thread(c.engine_pids)
        assert not alive & set(engines), f"killed engines still alive\n{report}"
    finally:
        await traffic.stop()
        await view.close()


def _two(hosts: set[str]) -> set[str] | None:
    return hosts if len(hosts) == 2 else None
