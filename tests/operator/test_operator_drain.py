"""Drain that drops nothing (issue 6, ARCHITECTURE #8), with every part a real process.

nats-server, a control plane, a router and three agents with simulated GPUs and simulated engines; one
model with one replica. Clients send requests without pause (half streamed, half not) while the node
hosting the replica is drained with `llmgw ctl drain NODE --grace 60s`. Every response must be a 200
(and every stream end with [DONE]); the replica must end up on another node, and the old engine must be
gone once its in-flight requests have finished.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.chaos.chaos_bus import BUS_ERRORS, BusView, timed
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster
from tests.chaos.chaos_traffic import Record, Traffic, wait_serving
from tests.chaos.chaos_waits import mint_key, wait_endpoints
from tests.kit.poll import eventually

pytestmark = [pytest.mark.xdist_group("operator"), pytest.mark.e2e, pytest.mark.slow]

# Each request streams ~40 tokens at 100 tokens/s: ~0.4 s in flight, so a drain always meets some.
CATALOG = """\
models:
  - name: chat
    engine: vllm
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: 1
    startup_timeout_s: 30
    options: {startup_s: 1.0, ttft_ms: 20, tokens_per_s: 100, slots: 64}
"""


class MixedTraffic(Traffic):
    """Even clients stream, odd clients do not; a non-streamed answer must be a 200 with a choice."""

    async def one(self, http: httpx.AsyncClient, client: int) -> Record:
        if client % 2 == 0:
            return await super().one(http, client)
        t0 = time.monotonic()
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "drain"}],
            "max_tokens": self.max_tokens,
        }
        try:
            r = await http.post(
                f"{self.base_url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {self.key}"},
            )
        except httpx.HTTPError as e:
            return Record(client, t0, time.monotonic(), False, f"{type(e).__name__}: {e}"[:160])
        if r.status_code != 200:
            return Record(client, t0, time.monotonic(), False, f"HTTP {r.status_code}: {r.text[:160]}")
        if not r.json().get("choices"):
            return Record(client, t0, time.monotonic(), False, f"no choices: {r.text[:160]}")
        return Record(client, t0, time.monotonic(), True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChaosCluster, str]]:
    c = ChaosCluster(Path(tmp_path_factory.mktemp("operator-drain")), prefix="drain", catalog=CATALOG)
    c.settings = {**AGGRESSIVE, "LLMGW_STOP_GRACE_S": "10"}
    try:
        c.start_nats()
        c.start_controlplane()
        c.start_router()
        for n in ("n1", "n2", "n3"):
            c.start_agent(n)
        key = mint_key(c)
        c.wait_router()
        wait_endpoints(c, "chat", 1, 60)
        yield c, key
    finally:
        c.close()


async def _ctl(c: ChaosCluster, *args: str) -> str:
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw_cli", "ctl", *args, "--nats", c.nats_url, "--prefix", c.prefix,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=c.env(),
    )  # fmt: skip
    out, err = await p.communicate()
    assert p.returncode == 0, f"ctl {' '.join(args)}: {err.decode()}"
    return out.decode()


async def test_drain_under_traffic_drops_nothing(cluster: tuple[ChaosCluster, str]) -> None:
    c, key = cluster
    view = await BusView.connect(c.nats_url, c.prefix)
    traffic = MixedTraffic(c.router_url(), key, clients=4, max_tokens=40)
    try:
        await wait_serving(c.router_url(), key)
        nodes = await eventually(
            lambda: _nodes(view), timeout=15, every=0.2, what="chat to have one endpoint", tolerate=BUS_ERRORS
        )
        assert nodes is not None
        (old_node,) = nodes
        old_pids = await eventually(
            lambda: _pids(view, old_node),
            timeout=10,
            every=0.2,
            what=f"chat's engine pid on {old_node}",
            tolerate=BUS_ERRORS,
        )
        traffic.start()
        await traffic.run_for(2.0)
        t_drain = time.monotonic()
        said = await _ctl(c, "drain", old_node, "--grace", "60s")
        assert f"node {old_node} draining" in said, said

        async def moved() -> list[str] | None:
            nodes = await view.endpoint_nodes("chat")
            return nodes if nodes and old_node not in nodes else None

        new_nodes, took = await timed(f"chat to be served away from {old_node}", moved, 45)

        async def old_gone() -> bool:
            return not any(psutil.pid_exists(p) for p in old_pids) and not view.nodes_hosting("chat") & {
                old_node
            }

        _, gone = await timed(f"the old engine on {old_node} to stop", old_gone, 30)
        await traffic.run_for(2.0)
        await traffic.stop()
        every = traffic.all("all requests")
        during = traffic.between(t_drain, t_drain + took + gone, "started during the drain")
        streamed = sum(1 for r in every.records if r.client % 2 == 0)
        report = (
            f"drain of {old_node}: replacement serving on {new_nodes} after {took:.1f}s, old engine "
            f"{old_pids} stopped {gone:.1f}s later\n  {every.line()} ({streamed} streamed, "
            f"{len(every.records) - streamed} not)\n  {during.line()}"
        )
        print(report)
        assert not every.failed, report
        assert during.ok > 10, report
        assert old_node not in new_nodes and len(new_nodes) == 1, report
        # The replica's record moved: the only one left is on the new node.
        recs = await view.records()
        assert [s.node for r in recs.values() for s in r.shards] == new_nodes, recs
        assert not any(r.draining for r in recs.values()), recs
    finally:
        await traffic.stop()
        await view.close()


async def _nodes(view: BusView) -> list[str] | None:
    nodes = await view.endpoint_nodes("chat")
    return nodes if len(nodes) == 1 else None


async def _pids(view: BusView, node: str) -> set[int]:
    return set(view.engine_pids(node).values())
