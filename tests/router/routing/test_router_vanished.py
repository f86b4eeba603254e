"""A node that vanishes without closing its connections (power loss, partition, a frozen engine).

Its engine's TCP connections stay open and nothing flows: without more, a stream on it would hang for
``read_timeout_s``. Two ways out, both through mid-stream failover: the routing table withdrawing the
endpoint (the control plane declared its node lost) aborts the streams in flight to it once silent
for ``withdrawn_silence_s`` (one still flowing finishes), and a stream
silent for ``stream_stall_s`` after its first byte is taken as broken. SIGSTOP freezes a real sim
engine process: its sockets stay open, nothing is read or written.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.messages import Endpoint
from llmgw_router.service import Router
from llmgw_runtime.natsserver import NatsServer
from llmgw_sim.options import SimOptions
from tests.kit.poll import eventually
from tests.router.failover.test_router_failover import _check, _stream
from tests.router.router_helpers import (
    EngineProcs,
    RouterFactory,
    StaticFile,
    start_engine_process,
    stop_engine_processes,
)
from tests.router.test_router_bus import _publish_routing

pytestmark = pytest.mark.slow

TOKENS = 200
# Well under the default read_timeout_s (600 s) and stream_stall_s (60 s): only the fix meets it.
DEADLINE_S = 25.0


@pytest.fixture
def sims() -> Iterator[EngineProcs]:
    """Two sim engine processes (own sessions), 50 tokens/s: a 200-token answer takes 4 s."""
    procs: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for _ in range(2):
            opts = SimOptions(port=0, model="m1", ttft_ms=20, tokens_per_s=50, slots=16)
            procs.append(start_engine_process("m1", opts))
        yield procs
    finally:
        stop_engine_processes(procs)


def _chat() -> dict[str, Any]:
    return {
        "model": "m1",
        "messages": [{"role": "user", "content": "vanish alpha beta gamma"}],
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _endpoints(sims: EngineProcs, **draining: bool) -> dict[str, list[Endpoint]]:
    eps = [
        Endpoint(replica_id=f"r{i}", model="m1", url=url, node=f"n{i}", draining=draining.get(f"r{i}", False))
        for i, (_, url) in enumerate(sims)
    ]
    return {"m1": eps}


async def _serving(r: Router, sims: EngineProcs) -> int:
    """The index of the engine the one stream in flight went to, once tokens flow on it."""

    def busy() -> list[int]:
        eps = r.ctx.pool.by_key.values()
        return [i for i, (_, u) in enumerate(sims) for e in eps if e.url == u and e.in_flight]

    await eventually(lambda: len(busy()) == 1, timeout=10.0, what="the stream to reach an engine")
    await asyncio.sleep(0.5)  # about 25 tokens reach the client
    return busy()[0]


async def _bus_router(
    routers: RouterFactory, nats_server: NatsServer, prefix: str, nc: NATS, sims: EngineProcs
) -> Router:
    await _publish_routing(nc, prefix, _endpoints(sims))
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, auth=False, tick_s=0.2)
    await asyncio.wait_for(r.synced.wait(), 10)
    await eventually(
        lambda: len(r.ctx.pool.by_key) == 2, timeout=10.0, what="the router to know both endpoints"
    )
    return r


async def test_withdrawn_endpoint_aborts_its_frozen_stream(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, sims: EngineProcs
) -> None:
    r = await _bus_router(routers, nats_server, prefix, nc, sims)
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    body = _chat()
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(_stream(s, url, body))
        victim = await _serving(r, sims)
        os.killpg(sims[victim][0].pid, signal.SIGSTOP)
        # The control plane declares the node lost: its endpoint leaves the routing table.
        left = [e for e in _endpoints(sims)["m1"] if e.replica_id != f"r{victim}"]
        await _publish_routing(nc, prefix, {"m1": left}, version=2)
        status, events = await asyncio.wait_for(task, DEADLINE_S)
    assert _check("/v1/chat/completions", body, status, events) == ""
    assert r.ctx.metrics.migrations_count("m1", "ok") == 1
    await eventually(
        lambda: r.ctx.metrics.in_flight == 0 and all(e.in_flight == 0 for e in r.ctx.pool.by_key.values()),
        timeout=5.0,
        what="no request to be in flight at the router or any endpoint",
    )


async def test_a_withdrawn_endpoint_still_streaming_finishes_its_stream(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, sims: EngineProcs
) -> None:
    """Every endpoint withdrawn while a stream flows (partition case 4b: both replicas' nodes on a
    nats-server cut from the others, their engines answering still): the stream finishes where it is.
    Aborted at once, it broke with no replica left to continue it."""
    r = await _bus_router(routers, nats_server, prefix, nc, sims)
    assert r.ctx.limits.withdrawn_silence_s == 2.0
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    body = _chat()
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(_stream(s, url, body))
        await _serving(r, sims)
        await _publish_routing(nc, prefix, {"m1": []}, version=2)
        await eventually(lambda: not r.ctx.pool.by_key, timeout=10.0, what="every endpoint withdrawn")
        status, events = await asyncio.wait_for(task, DEADLINE_S)
    assert _check("/v1/chat/completions", body, status, events) == ""
    assert r.ctx.metrics.migrations_count("m1", "ok") == 0
    assert r.ctx.metrics.migrations_count("m1", "failed") == 0


async def test_a_draining_flag_aborts_nothing(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, sims: EngineProcs
) -> None:
    r = await _bus_router(routers, nats_server, prefix, nc, sims)
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    body = _chat()
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(_stream(s, url, body))
        serving = await _serving(r, sims)
        await _publish_routing(nc, prefix, _endpoints(sims, **{f"r{serving}": True}), version=2)
        await eventually(
            lambda: any(e.draining for e in r.ctx.pool.by_key.values()),
            timeout=10.0,
            what="an endpoint to be draining",
        )
        status, events = await asyncio.wait_for(task, DEADLINE_S)
    assert _check("/v1/chat/completions", body, status, events) == ""
    # The drained replica finished what it held: nothing migrated.
    assert r.ctx.metrics.migrations_count("m1", "ok") == 0
    assert r.ctx.metrics.migrations_count("m1", "failed") == 0


async def test_a_stalled_stream_migrates_after_stream_stall_s(
    routers: RouterFactory, static_file: StaticFile, sims: EngineProcs
) -> None:
    r = await routers(static_file({"m1": [u for _, u in sims]}, auth=False), stream_stall_s=1.0)
    assert r.settings.read_timeout_s == 600.0
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    body = _chat()
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(_stream(s, url, body))
        victim = await _serving(r, sims)
        os.killpg(sims[victim][0].pid, signal.SIGSTOP)
        status, events = await asyncio.wait_for(task, DEADLINE_S)
    assert _check("/v1/chat/completions", body, status, events) == ""
    assert r.ctx.metrics.migrations_count("m1", "ok") == 1
