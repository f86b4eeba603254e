"""Fresh load (issue 34), for real: a change in an engine's load reaches a router within a second.

A real agent process runs a real simulator process; the requests go straight to the engine, so the
router's own in-flight count stays 0 and only the agent's load reports can move what it knows. The
agent reads the engine every 125 ms and sends a change at once (at most every 250 ms): the router sees
each step well within a second, where a 1 s scrape-and-send tick took up to a second and more.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import encode
from llmgw_common.messages import Assignment, Endpoint, RoutingCatalog, RoutingEndpoints, ShardAssignment
from llmgw_common.subjects import Subjects
from llmgw_router.routing.endpoints import EndpointState
from llmgw_runtime.bus import ensure_kv
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.kit.ports import free_port
from tests.router.router_helpers import RouterFactory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NODE = "fresh"


def start_agent(url: str, prefix: str, state_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    # The agent's defaults: its 1 s tick, 2 s heartbeats, 125 ms reads, 250 ms gaps.
    argv = [sys.executable, "-m", "llmgw_cli", "agent", "--nats", url, "--prefix", prefix, "--node", NODE]
    argv += ["--state-dir", str(state_dir), "--simulate-engines"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    with log.open("ab") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


async def _router_sees(state: EndpointState, running: int) -> None:
    await eventually(lambda: state.running == running, timeout=5, every=0.01, what=f"{running} running")


async def test_a_change_in_an_engines_load_reaches_a_router_within_a_second(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path, routers: RouterFactory
) -> None:
    subjects = Subjects(prefix)
    port = free_port()
    shard = ShardAssignment(
        replica_id="r1",
        shard=0,
        model="m1",
        engine="sim",
        port=port,
        options={"ttft_ms": 1, "tokens_per_s": 20},
    )
    assign = await ensure_kv(nc.jetstream(), subjects.bucket_assign)
    await assign.put(NODE, encode(Assignment(node=NODE, fence=1, shards=(shard,))))
    routing = await ensure_kv(nc.jetstream(), subjects.bucket_routing)
    cat = Catalog(models=(ModelProfile(name="m1", engine="sim"),))
    await routing.put("catalog", encode(RoutingCatalog(version=1, catalog=cat)))
    ep = Endpoint(replica_id="r1", model="m1", url=f"http://127.0.0.1:{port}", node=NODE)
    await routing.put("endpoints", encode(RoutingEndpoints(version=1, endpoints={"m1": (ep,)})))
    log = tmp_path / "agent.log"
    agent = start_agent(nats_server.url, prefix, tmp_path / "agent", log)
    try:
        r = await routers(nats_urls=[nats_server.url], prefix=prefix, auth=False)
        await asyncio.wait_for(r.synced.wait(), 10)
        state = await eventually(
            lambda: next(iter(r.ctx.pool.by_replica.get("r1", ())), None), timeout=10, what="the endpoint"
        )
        # The engine ready and read: the router knows it idle.
        await eventually(
            lambda: state.running == 0.0, timeout=60, what=f"a first load report (agent log: {log})"
        )
        loop = asyncio.get_running_loop()
        lags: list[float] = []
        body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
        async with httpx.AsyncClient(timeout=30) as http:
            for n in (1, 3, 2, 1):
                t0 = loop.time()
                # 40 tokens at 20 a second: each request runs 2 s, time for its step up to be seen.
                sent = [
                    asyncio.create_task(http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body))
                    for _ in range(n)
                ]
                await _router_sees(state, n)
                lags.append(loop.time() - t0)
                assert all(x.status_code == 200 for x in await asyncio.gather(*sent))
                t1 = loop.time()
                await _router_sees(state, 0)
                lags.append(loop.time() - t1)
        assert r.ctx.pool.by_replica["r1"][0].in_flight == 0  # only the reports moved it
        # Each step within a second (a 1 s tick's worst case), typically a fraction of it.
        assert max(lags) <= 1.0, lags
        assert statistics.median(lags) <= 0.4, lags
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(agent.wait, 20)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
