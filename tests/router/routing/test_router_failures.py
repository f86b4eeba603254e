"""Failures: retries before the first byte, the breaker, client disconnects, an engine killed under load."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import aiohttp
import pytest

from llmgw_router.routing.breaker import BreakerState
from tests.kit.poll import eventually
from tests.router.router_helpers import (
    CountingUpstream,
    EngineFactory,
    PortFactory,
    RouterFactory,
    StaticFile,
    breaker_state,
    start_engine_process,
)


def _chat(max_tokens: int = 2, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "m1",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def test_connect_failures_are_retried_on_another_endpoint_and_open_the_breaker(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile, port: PortFactory
) -> None:
    good = await engines("m1")
    dead = f"http://127.0.0.1:{port()}"  # nothing listens there
    r = await routers(static_file({"m1": [dead, good.url]}, auth=False))
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        for _ in range(30):
            async with s.post(url, json=_chat()) as resp:
                assert resp.status == 200, await resp.text()
    dead_ep = next(e for e in r.ctx.pool.by_key.values() if e.url == dead)
    assert dead_ep.breaker.state is BreakerState.OPEN
    assert r.ctx.metrics.retries_count("m1") >= 1
    assert r.ctx.metrics.in_flight == 0 and all(e.in_flight == 0 for e in r.ctx.pool.by_key.values())
    # With the breaker open the dead endpoint is skipped: no more retries are needed.
    before = r.ctx.metrics.retries_count("m1")
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            async with s.post(url, json=_chat()) as resp:
                assert resp.status == 200
    assert r.ctx.metrics.retries_count("m1") == before


async def test_engine_503_is_retried_elsewhere(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    good = await engines("m1")
    # A real upstream that answers 503 "Loading model" and counts what reached it: the proof that the
    # router did try it (a router that skipped it would also answer every request with a 200).
    async with CountingUpstream(503, "Loading model") as loading:
        r = await routers(static_file({"m1": [loading.url, good.url]}, auth=False))
        statuses = []
        async with aiohttp.ClientSession() as s:
            # Until the 503 endpoint was tried (the choice is random) and its breaker opened.
            for _ in range(200):
                async with s.post(
                    f"http://127.0.0.1:{r.port}/v1/completions", json={"model": "m1", "prompt": "a"}
                ) as resp:
                    statuses.append(resp.status)
                if loading.hits >= 3:
                    break
        assert loading.hits >= 3, "the 503 endpoint was never tried"
        assert set(statuses) == {200}
        # Every 503 was retried on the other endpoint, and each request got there once.
        assert r.ctx.metrics.retries_count("m1") == loading.hits
        assert good.engine._served == len(statuses)
        dead = next(e for e in r.ctx.pool.by_key.values() if e.url == loading.url)
        assert dead.breaker.state is BreakerState.OPEN


@pytest.mark.slow
async def test_breaker_half_open_probe_closes_it(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    # One replica that is loading for a moment: 503s open its breaker, the client gets 503 (not 502,
    # not 429), and once it loads a half-open probe closes the breaker again.
    eng = await engines("m1", startup_s=0.5)
    r = await routers(static_file({"m1": [eng.url]}, auth=False))
    ep = next(iter(r.ctx.pool.by_key.values()))
    ep.breaker.base_cooldown_s = 0.3
    url = f"http://127.0.0.1:{r.port}/v1/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={"model": "m1", "prompt": "a"}) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"]
            assert "Loading model" in (await resp.json())["error"]["message"]
        assert ep.breaker.state is BreakerState.OPEN
        async with s.post(url, json={"model": "m1", "prompt": "a"}) as resp:
            assert resp.status == 503 and "circuit open" in (await resp.json())["error"]["message"]
        await eventually(
            lambda: eng.engine.loaded and ep.breaker.allows(time.time()),
            timeout=5.0,
            what="the engine to load and the breaker to allow a probe",
        )
        async with s.post(url, json={"model": "m1", "prompt": "a"}) as resp:
            assert resp.status == 200
    assert breaker_state(ep.breaker) is BreakerState.CLOSED


async def test_client_disconnect_mid_stream_releases_everything(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    slow = await engines("m1", ttft_ms=10, tokens_per_s=20)
    r = await routers(static_file({"m1": [slow.url]}, auth=False))
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    ep = next(iter(r.ctx.pool.by_key.values()))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url, json=_chat(max_tokens=200, stream=True))
        assert resp.status == 200
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        assert r.ctx.metrics.in_flight == 1 and ep.in_flight == 1 and slow.engine.slots.running == 1
        resp.close()  # hang up mid-stream
    await eventually(
        lambda: r.ctx.metrics.in_flight == 0 and ep.in_flight == 0 and r.ctx.gates.by_model["m1"].active == 0,
        timeout=5.0,
        what="the router, the endpoint and the gate to release the request",
    )
    # The engine was told too (its connection closed): it stops generating.
    await eventually(
        lambda: slow.engine.slots.running == 0,
        timeout=5.0,
        what="the engine to stop generating for the departed client",
    )
    assert r.ctx.metrics.requests_count("m1", 499) == 1


async def test_client_disconnect_before_first_byte_releases_everything(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    slow = await engines("m1", ttft_ms=3000, tokens_per_s=100)
    r = await routers(static_file({"m1": [slow.url]}, auth=False))
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
        with pytest.raises(TimeoutError):
            async with s.post(url, json=_chat()) as resp:
                await resp.read()
    await eventually(
        lambda: r.ctx.metrics.in_flight == 0 and r.ctx.gates.by_model["m1"].active == 0,
        timeout=5.0,
        what="the router and the gate to release the request",
    )
    ep = next(iter(r.ctx.pool.by_key.values()))
    assert ep.in_flight == 0 and ep.breaker.state is BreakerState.CLOSED


@pytest.mark.slow
async def test_killing_one_of_two_engines_fails_no_request_started_after_the_kill(
    routers: RouterFactory, static_file: StaticFile
) -> None:
    procs = []
    try:
        for _ in range(2):
            procs.append(await asyncio.to_thread(start_engine_process, "m1"))
        r = await routers(static_file({"m1": [u for _, u in procs]}, auth=False))
        url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
        killed_at: list[float] = []
        results: list[tuple[float, int]] = []
        stop = asyncio.Event()

        async def worker(s: aiohttp.ClientSession) -> None:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    async with s.post(url, json=_chat()) as resp:
                        await resp.read()
                        results.append((t, resp.status))
                except aiohttp.ClientError:
                    results.append((t, -1))

        async with aiohttp.ClientSession() as s:
            workers = [asyncio.create_task(worker(s)) for _ in range(8)]
            await eventually(lambda: len(results) >= 200, timeout=20.0, what="200 answers before the kill")
            os.killpg(procs[0][0].pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
            n_at_kill = len(results)
            await eventually(
                lambda: len(results) >= n_at_kill + 400, timeout=30.0, what="400 answers after the kill"
            )
            stop.set()
            await asyncio.gather(*workers)
        after = [st for t, st in results if t >= killed_at[0]]
        assert len(after) >= 400
        assert [st for st in after if st != 200] == []
        # Requests in flight at the kill were retried too (nothing reached their clients yet).
        assert [st for _, st in results if st != 200] == []
        # ...and it was the retries that saved them: the dead endpoint was hit and its breaker opened.
        assert r.ctx.metrics.retries_count("m1") >= 1
        dead = next(e for e in r.ctx.pool.by_key.values() if e.url == procs[0][1])
        assert dead.breaker.state is not BreakerState.CLOSED
        assert r.ctx.metrics.in_flight == 0
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            await asyncio.to_thread(p.wait)
            if p.stdout:
                p.stdout.close()
