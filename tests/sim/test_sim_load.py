"""Slots, waiting queue, metrics, timing, loading and health faults of the simulated engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from llmgw_sim.serving import Listening
from llmgw_sim.slots import Slots
from tests.kit.poll import eventually
from tests.sim.sim_testkit import parse_metrics

Engine = Callable[..., Awaitable[Listening]]


def chat(max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "w1 w2"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def metrics(http: aiohttp.ClientSession, srv: Listening) -> dict[str, tuple[str, float]]:
    async with http.get(srv.url + "/metrics") as r:
        assert r.status == 200
        return parse_metrics(await r.text())


async def post_chat(http: aiohttp.ClientSession, srv: Listening, body: dict[str, Any]) -> int:
    async with http.post(srv.url + "/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status


@pytest.mark.parametrize("style", ["vllm", "llamacpp"])
@pytest.mark.slow
async def test_running_and_waiting_are_true_under_load(
    engine: Engine, http: aiohttp.ClientSession, style: str
) -> None:
    # Two slots, five slow requests: two run, three wait, until all are done.
    srv = await engine(slots=2, ttft_ms=400, tokens_per_s=1000, metrics_style=style)
    running = "vllm:num_requests_running" if style == "vllm" else "llamacpp:requests_processing"
    waiting = "vllm:num_requests_waiting" if style == "vllm" else "llamacpp:requests_deferred"
    tasks = [asyncio.create_task(post_chat(http, srv, chat(stream=i % 2 == 1))) for i in range(5)]

    async def queued() -> bool:
        m = await metrics(http, srv)
        return m[running][1] == 2 and m[waiting][1] == 3

    await eventually(queued, timeout=5, what="2 running and 3 waiting requests")
    m = await metrics(http, srv)
    if style == "vllm":
        assert m["vllm:kv_cache_usage_perc"][1] == 1.0
        assert m[running][0] == '{engine="0",model_name="sim-model"}'
    else:
        assert not [k for k in m if "kv" in k], "a current llama-server has no KV-cache metric"
        assert m[running][0] == ""
    assert await asyncio.gather(*tasks) == [200] * 5
    m = await metrics(http, srv)
    assert (m[running][1], m[waiting][1]) == (0, 0)
    gen = "vllm:generation_tokens_total" if style == "vllm" else "llamacpp:tokens_predicted_total"
    prompt = "vllm:prompt_tokens_total" if style == "vllm" else "llamacpp:prompt_tokens_total"
    assert m[gen][1] == 20
    assert m[prompt][1] == 10


async def test_kv_usage_is_share_of_slots(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(slots=4, ttft_ms=300)
    task = asyncio.create_task(post_chat(http, srv, chat()))

    async def one_running() -> bool:
        return (await metrics(http, srv))["vllm:num_requests_running"][1] == 1

    await eventually(one_running, timeout=5, what="one request to be running")
    assert (await metrics(http, srv))["vllm:kv_cache_usage_perc"][1] == 0.25
    assert await task == 200


async def test_kv_usage_by_token_count(engine: Engine, http: aiohttp.ClientSession) -> None:
    # Prompt of 2 words + 8 tokens held by each of two running requests, of 100.
    srv = await engine(slots=4, ttft_ms=300, kv_tokens=100)
    tasks = [asyncio.create_task(post_chat(http, srv, chat(max_tokens=8, stream=s))) for s in (False, True)]

    async def two_running() -> bool:
        return (await metrics(http, srv))["vllm:num_requests_running"][1] == 2

    await eventually(two_running, timeout=5, what="two requests to be running")
    assert (await metrics(http, srv))["vllm:kv_cache_usage_perc"][1] == 0.2
    assert await asyncio.gather(*tasks) == [200, 200]
    assert (await metrics(http, srv))["vllm:kv_cache_usage_perc"][1] == 0.0


async def test_ttft_and_tokens_per_s_shape_a_stream(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(ttft_ms=200, tokens_per_s=50)
    arrivals: list[float] = []
    t0 = time.monotonic()
    async with http.post(srv.url + "/v1/chat/completions", json=chat(max_tokens=6, stream=True)) as r:
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content": "' in line and b'"content": ""' not in line:
                arrivals.append(time.monotonic() - t0)
    assert len(arrivals) == 6
    assert arrivals[0] >= 0.19
    # Five more tokens at 50/s: 100 ms more, give or take the scheduler.
    assert arrivals[-1] - arrivals[0] >= 0.09
    assert arrivals[-1] < 2.0


async def test_non_streaming_takes_ttft_plus_decode(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(ttft_ms=100, tokens_per_s=100)
    t0 = time.monotonic()
    assert await post_chat(http, srv, chat(max_tokens=11)) == 200
    assert time.monotonic() - t0 >= 0.19


async def test_zero_mode_has_no_delay(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(ttft_ms=5000, tokens_per_s=1, zero=True)
    t0 = time.monotonic()
    assert await post_chat(http, srv, chat(max_tokens=50)) == 200
    assert await post_chat(http, srv, chat(max_tokens=50, stream=True)) == 200
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("stream", [False, True])
async def test_client_hanging_up_frees_its_place(
    engine: Engine, http: aiohttp.ClientSession, stream: bool
) -> None:
    srv = await engine(slots=1, ttft_ms=3000)
    holder = asyncio.create_task(post_chat(http, srv, chat(stream=stream)))
    queued = asyncio.create_task(post_chat(http, srv, chat(stream=stream)))

    async def one_waiting() -> bool:
        return (await metrics(http, srv))["vllm:num_requests_waiting"][1] == 1

    await eventually(one_waiting, timeout=5, what="one request to be waiting")
    queued.cancel()
    holder.cancel()

    async def idle() -> bool:
        m = await metrics(http, srv)
        return m["vllm:num_requests_waiting"][1] == 0 and m["vllm:num_requests_running"][1] == 0

    await eventually(idle, timeout=5, what="the engine to be idle after both clients left")
    await asyncio.gather(holder, queued, return_exceptions=True)


@pytest.mark.slow
async def test_startup_delay_then_ready(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(startup_s=0.5, zero=True)
    async with http.get(srv.url + "/health") as r:
        assert r.status == 503
        assert (await r.json())["error"]["message"] == "Loading model"
    async with http.post(srv.url + "/v1/chat/completions", json=chat()) as r:
        assert r.status == 503
        assert "Loading" in (await r.json())["error"]["message"]

    async def healthy() -> bool:
        async with http.get(srv.url + "/health") as r:
            return r.status == 200

    await eventually(healthy, timeout=5, what="/health to answer 200 after loading")
    assert await post_chat(http, srv, chat()) == 200


async def test_fail_health_fault_keeps_serving(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(fail_health=True, zero=True)
    for _ in range(3):
        async with http.get(srv.url + "/health") as r:
            assert r.status == 503
            assert "fail_health" in (await r.json())["error"]["message"]
    assert await post_chat(http, srv, chat()) == 200


async def test_healthy_engine_says_ok(engine: Engine, http: aiohttp.ClientSession) -> None:
    srv = await engine(zero=True)
    async with http.get(srv.url + "/health") as r:
        # vLLM's /health: a bare 200.
        assert r.status == 200
        assert await r.read() == b""


# ---------------------------------------------------------------- Slots on its own


async def test_slots_hand_over_in_arrival_order() -> None:
    s = Slots(1)
    await s.acquire()
    order: list[int] = []

    async def take(i: int) -> None:
        await s.acquire()
        order.append(i)
        s.release()

    tasks = [asyncio.create_task(take(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert (s.running, s.waiting) == (1, 3)
    s.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert (s.running, s.waiting) == (0, 0)


async def test_slots_cancelled_waiter_leaves_queue() -> None:
    s = Slots(1)
    await s.acquire()
    t = asyncio.create_task(s.acquire())
    await asyncio.sleep(0)
    assert s.waiting == 1
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert (s.running, s.waiting) == (1, 0)
    s.release()
    assert s.running == 0


async def test_slots_cancelled_after_handover_passes_slot_on() -> None:
    s = Slots(1)
    await s.acquire()
    first = asyncio.create_task(s.acquire())
    second = asyncio.create_task(s.acquire())
    await asyncio.sleep(0)
    s.release()  # hands the slot to `first`...
    first.cancel()  # ...which is cancelled before it runs: `second` must get it.
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    assert (s.running, s.waiting) == (1, 0)


async def test_slots_cancelled_waiter_already_skipped_by_release() -> None:
    s = Slots(1)
    await s.acquire()
    t = asyncio.create_task(s.acquire())
    await asyncio.sleep(0)
    t.cancel()
    s.release()  # pops the cancelled waiter, skips it, and frees the slot
    with pytest.raises(asyncio.CancelledError):
        await t
    assert (s.running, s.waiting) == (0, 0)
