"""Drain and scale to zero with real vLLM: its real start time is what a drain and a wake wait for.

On the session's cluster (vllm_stage.py), with gemma alone on it (the catalog the cluster module's last
tests leave: no new cluster and no start between them). A drained node's replicas are replaced on the other node
before they stop, and requests meanwhile all succeed; a model gone cold is woken by a request that the
router holds for vLLM's whole start, streams getting ``: waking`` comments while they wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from llmgw_common.messages import RoutingEndpoints
from tests.chaos.chaos_bus import BusView
from tests.http_clients import async_client
from tests.kit.poll import eventually
from tests.vllm.vllm_cluster import GEMMA_PAIR, VllmCluster, catalog_yaml, chat_stream, endpoints, profile
from tests.vllm.vllm_kit import GEMMA

# Gemma on two replicas, one per node. Both tests start a third gemma for a while (the replacement
# before the drained one stops; the cold model): 5.3 GB each.
CATALOG = catalog_yaml(GEMMA_PAIR)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm"),
    pytest.mark.timeout(2400),
    pytest.mark.vllm_catalog(CATALOG),
]


async def _chat(http: httpx.AsyncClient, base: str, key: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return await http.post(
        f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )


# While the replacement starts, a request every 2 s; from the moment its engine answers /health (a
# second or two before the routing table flags node-b's replica draining) until node-b is empty, two
# clients back to back. Each request costs the engine about 0.45 s of CPU (idle box, 4 tokens): two a
# second throughout were 300 requests, about 130 s of the cores the replacement starts on.
SPARSE_PAUSE_S = 2.0
DENSE_CLIENTS = 2


async def _replacement_answers(http: httpx.AsyncClient, view: BusView, old: set[str]) -> bool:
    """A gemma replica on node-a that was not there before the drain answers /health."""
    hb = view.heartbeats.get("node-a")
    ports = [s.port for s in (hb.shards if hb else ()) if s.model == "gemma" and s.replica_id not in old]
    for port in ports:
        if port is None:
            continue
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get(f"http://127.0.0.1:{port}/health", timeout=1)).status_code == 200:
                return True
    return False


async def test_drain_moves_vllm_replicas_without_a_failed_request(cluster: tuple[VllmCluster, str]) -> None:
    c, key = cluster
    # The replicas before the drain, from the routing table (not from heartbeats, which a view just
    # connected may not have heard yet: every replica would then look new).
    serving = {e.replica_id for e in (await endpoints(c, "gemma", 2)).endpoints["gemma"]}
    view = await BusView.connect(c.nats_url, c.prefix)
    statuses: list[int] = []
    dense_at: list[int] = []  # how many requests had been answered when the dense phase began
    stop = asyncio.Event()
    dense = asyncio.Event()

    async def client(n: int) -> None:
        async with async_client(timeout=120) as http:
            if n > 0:
                await dense.wait()
            while not stop.is_set():
                statuses.append((await _chat(http, c.router_url(), key, "gemma")).status_code)
                if not dense.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(dense.wait(), SPARSE_PAUSE_S)

    async def watch(old: set[str]) -> None:
        # Ends with the test too: a replacement never seen answering fails the assertion below, not
        # a wait that never ends.
        async with async_client(timeout=2) as http:
            while not stop.is_set():
                if await _replacement_answers(http, view, old):
                    dense_at.append(len(statuses))
                    dense.set()
                    return
                await asyncio.sleep(0.25)

    tasks: list[asyncio.Task[None]] = []
    try:
        old = await eventually(lambda: view.engine_pids("node-b"), timeout=10, what="node-b's engines")
        tasks = [asyncio.create_task(client(n)) for n in range(DENSE_CLIENTS)]
        tasks.append(asyncio.create_task(watch(serving)))
        t0 = time.monotonic()
        # A grace longer than any start: on a box loaded to 13 the replacement took 7.5 minutes, and a
        # drain whose grace runs out stops the old replica before its replacement serves. The wait
        # below is as long: a replacement starting beside a serving replica on the same core took
        # over 400 s while other tests loaded the box.
        said = await c.ctl("drain", "node-b", "--grace", "20m")
        assert "node-b draining" in said, said

        async def moved() -> bool:
            eps = await view.endpoints()
            here = [e.node for e in (eps.endpoints.get("gemma", ()) if eps else ())]
            return len(here) == 2 and "node-b" not in here and not view.engine_pids("node-b")

        try:
            await eventually(
                moved, timeout=1000, every=0.5, what="gemma served from node-a only, node-b empty"
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{c.diagnostics()}") from None
        took = time.monotonic() - t0
        stop.set()
        dense.set()  # a dense client still waiting for its phase ends (dense_at says if it began)
        await asyncio.gather(*tasks)
        assert statuses and set(statuses) == {200}, statuses
        # Both phases had traffic: requests were answered while the replacement started (the dense
        # phase did not begin at once, on a replica mistaken for the replacement), and the handover's
        # dense phase began before node-b emptied and had an answer. Not more: on a loaded CI box one
        # 4-token chat took over 3 s, and a run saw 2 answers between the replacement's first /health
        # and node-b empty.
        assert dense_at and 0 < dense_at[0] < len(statuses), (dense_at, len(statuses))
        print(
            f"vllm drain: node-b's replicas {sorted(old)} replaced and stopped in {took:.1f} s, "
            f"{len(statuses)} ok ({len(statuses) - dense_at[0]} from the replacement's first /health on)"
        )
    finally:
        stop.set()
        dense.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await c.ctl("uncordon", "node-b")
        await view.close()
    await endpoints(c, "gemma", 2)


async def test_a_cold_vllm_model_wakes_for_a_held_request(cluster: tuple[VllmCluster, str]) -> None:
    """``cold`` (floor 0) has no replica; a stream and a plain request wait through a real vLLM start."""
    c, key = cluster
    cold = profile("cold", GEMMA, min_replicas=0, idle_after="20s", wake_timeout_s=900)
    await c.apply(catalog_yaml(GEMMA_PAIR, cold))
    view = await BusView.connect(c.nats_url, c.prefix)
    try:

        async def is_cold() -> RoutingEndpoints | None:
            eps = await view.endpoints()
            return eps if eps is not None and "cold" in eps.cold and not eps.endpoints.get("cold") else None

        # A model whose floor is 0 starts cold: nothing runs until a request wakes it.
        await eventually(is_cold, timeout=120, every=0.5, what="cold to be listed cold, with no endpoint")
        assert not view.nodes_hosting("cold"), f"a replica of cold runs already: {view.heartbeats}"
        comments: list[str] = []
        text: list[str] = []
        t0 = time.monotonic()
        first_text: float | None = None
        async with async_client(timeout=httpx.Timeout(950, connect=5)) as http:
            body = {
                "model": "cold",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8,
                "stream": True,
            }
            plain = asyncio.create_task(_chat(http, c.router_url(), key, "cold"))
            async with chat_stream(http, c, key, body) as lines:
                async for line in lines:
                    if line.startswith(":"):
                        comments.append(line)
                    elif line.startswith("data: ") and line != "data: [DONE]":
                        if first_text is None:
                            first_text = time.monotonic()
                        text.append(line)
            served = await plain
        assert first_text is not None and text, "the woken stream carried no data"
        waited = first_text - t0
        assert served.status_code == 200, served.text
        assert any("waking" in line and "cold" in line for line in comments), comments
        # A real vLLM start, not a replica that was there already.
        assert waited > 10, f"served {waited:.1f} s after the request: was it really cold?"
        print(
            f"vllm wake: first token {waited:.1f} s after a request for the cold model, {len(comments)} comments"
        )
    finally:
        await view.close()
        await c.apply(CATALOG)
    await endpoints(c, "gemma", 2)
