"""A stream cut by SIGKILL continues on the other replica, with real vLLM.

The last of the vLLM modules (they run in name order on one worker), on gemma's two replicas (the
catalog the lifecycle module leaves). Both nodes are cordoned for the test: the killed replica's
replacement would be a vLLM start (about 55 s of CPU) that no test needs, and a cordon only stops new
placements. The nodes are uncordoned after it, so a test run after this one still gets its replicas
(the stage waits for them).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import httpx
import pytest

from llmgw_runtime.ctl_client import CtlClient
from tests.chaos.chaos_bus import BusView
from tests.http_clients import async_client
from tests.kit.poll import eventually
from tests.vllm.vllm_cluster import (
    GEMMA_PAIR,
    NODES,
    LoadWatch,
    VllmCluster,
    catalog_yaml,
    chat_stream,
    endpoints,
)

CATALOG = catalog_yaml(GEMMA_PAIR)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1500)]


async def test_stream_cut_by_sigkill_continues_on_the_other_replica(cluster: tuple[VllmCluster, str]) -> None:
    """The replica streaming is SIGKILLed (its whole group: API server, EngineCore) mid-stream;
    the router continues the stream on the other replica: one id, one finish_reason, one [DONE]."""
    c, key = cluster
    table = await endpoints(c, "gemma", 2)
    ids = {e.replica_id for e in table.endpoints["gemma"]}
    loads = await LoadWatch.connect(c, NODES)
    view = await BusView.connect(c.nats_url, c.prefix)
    # ~70 tokens after the kill (it comes at the 8th word): 3 s on an idle core, long after a load report
    # (every 0.5 s) names the victim; 120 took 2 minutes of a loaded CI box.
    tokens = 80
    body = {
        "model": "gemma",
        "messages": [{"role": "user", "content": "Write a story about a lighthouse keeper."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    events: list[tuple[float, dict[str, Any]]] = []
    done = 0
    killed_at: float | None = None
    victim: str | None = None
    ctl = CtlClient(view.nc, c.prefix, timeout=10)
    try:
        for node in NODES:
            await ctl.cordon(node)
        async with async_client(timeout=httpx.Timeout(180, connect=5)) as http:
            async with chat_stream(http, c, key, body) as lines:
                async for line in lines:
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done += 1
                        continue
                    events.append((time.monotonic(), json.loads(line[6:])))
                    if killed_at is None and _text(events).count(" ") >= 8:
                        victim = await _serving(loads, ids)
                        pid = view.engine_pids().get((victim, 0))
                        assert pid is not None, f"no pid for {victim}: {view.engine_pids()}"
                        os.killpg(pid, signal.SIGKILL)
                        killed_at = time.monotonic()
    finally:
        for node in NODES:
            await ctl.uncordon(node)
        await loads.close()
        await view.close()
    assert killed_at is not None, f"the stream ended before the kill: {_text(events)!r}"
    chunk_ids = {e["id"] for _, e in events}
    finishes = [
        ch["finish_reason"] for _, e in events for ch in e.get("choices", ()) if ch.get("finish_reason")
    ]
    errors = [e for _, e in events if "error" in e]
    assert not errors, errors
    assert len(chunk_ids) == 1, chunk_ids
    assert finishes == ["length"], finishes
    assert done == 1
    usage = [e["usage"] for _, e in events if e.get("usage")]
    assert usage and abs(usage[-1]["completion_tokens"] - tokens) <= 3, usage
    after = [
        t
        for t, e in events
        if t > killed_at and any(ch.get("delta", {}).get("content") for ch in e["choices"])
    ]
    assert after, "no text after the kill"
    print(f"vllm failover: first text {after[0] - killed_at:.2f} s after the SIGKILL of {victim}")


def _text(events: list[tuple[float, dict[str, Any]]]) -> str:
    return "".join(ch.get("delta", {}).get("content") or "" for _, e in events for ch in e.get("choices", ()))


async def _serving(loads: LoadWatch, ids: set[str]) -> str:
    """The replica whose load report shows the one request running."""

    def busy() -> str | None:
        hits = [r for r in ids if (ld := loads.load(r)) is not None and (ld.running or 0) >= 1]
        return hits[0] if len(hits) == 1 else None

    found = await eventually(busy, timeout=10, every=0.05, what="the one replica running the stream")
    assert found is not None
    return found
