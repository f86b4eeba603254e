"""The simulated engine's prefix cache at work: vLLM's KV events on a real ZMQ socket (read back with
the agent's decoder), the prefix-cache counters of /metrics, the reset route, cache_salt, and a
prefill that takes the time of its uncached tokens."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from llmgw_common.simtokens import prompt_token_ids, word_id
from llmgw_common.vllm_kv_events import AllBlocksCleared, BlockStored, EventBatch, decode_frames
from llmgw_sim.options import SimOptions
from llmgw_sim.serving import Listening, start
from tests.sim.sim_testkit import EngineProcess, parse_metrics

Spawn = Callable[[SimOptions], Awaitable[EngineProcess]]
MODEL = "sim-model"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # An ipc:// path must fit a unix socket's ~107 bytes; pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="kv", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
async def subscriber() -> AsyncIterator[Callable[[str], Awaitable[zmq.asyncio.Socket]]]:
    ctx = zmq.asyncio.Context()
    socks: list[zmq.asyncio.Socket] = []

    async def connect(endpoint: str) -> zmq.asyncio.Socket:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        socks.append(sub)
        # A subscriber gets what is sent after its connection is made (ZMQ's "slow joiner").
        await asyncio.sleep(0.3)
        return sub

    yield connect
    for s in socks:
        s.close(linger=0)
    ctx.term()


async def next_batch(sub: zmq.asyncio.Socket) -> tuple[str, int, EventBatch]:
    frames = await asyncio.wait_for(sub.recv_multipart(), 5)
    return decode_frames(frames)


async def chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]], **extra: Any) -> str:
    body = {"model": MODEL, "messages": messages, **extra}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    text: str = out["choices"][0]["message"]["content"]
    return text


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        return {k: v for k, (_, v) in parse_metrics(await r.text()).items()}


@pytest.mark.slow
@pytest.mark.e2e
async def test_the_engine_publishes_vllms_events_for_the_blocks_a_router_predicts(
    engine_process: Spawn,
    subscriber: Callable[[str], Awaitable[zmq.asyncio.Socket]],
    http: aiohttp.ClientSession,
    sock_dir: Path,
) -> None:
    endpoint = f"ipc://{sock_dir}/kv.sock"
    ep = await engine_process(
        SimOptions(port=0, zero=True, block_size=4, kv_events_endpoint=endpoint, kv_events_topic="t1")
    )
    sub = await subscriber(endpoint)
    turn1 = [{"role": "user", "content": "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"}]
    ids1 = prompt_token_ids({"messages": turn1})
    assert ids1 is not None and len(ids1) == 12  # a role marker, 10 words, the generation prompt
    before = time.time()
    answer = await chat(http, ep.url, turn1, max_tokens=6)

    topic, seq, batch = await next_batch(sub)
    assert (topic, seq, batch.dp_rank) == ("t1", 0, 0)
    assert before - 1 <= batch.ts <= time.time() + 1
    (prefill,) = batch.events
    assert isinstance(prefill, BlockStored)
    # The prompt's 3 full blocks, with the token ids the router predicts from the same body.
    assert prefill.token_ids == tuple(ids1)
    assert len(prefill.block_hashes) == 3 and prefill.parent_block_hash is None
    assert (prefill.block_size, prefill.group_idx, prefill.kv_cache_spec_kind) == (4, 0, "full_attention")
    assert prefill.extra_keys == (None, None, None) and prefill.lora_name is None

    # The answer's end: the block its first tokens filled (all but the last token are computed).
    _, seq, batch = await next_batch(sub)
    assert seq == 1
    (decoded,) = batch.events
    assert isinstance(decoded, BlockStored)
    assert decoded.parent_block_hash == prefill.block_hashes[-1]
    words = answer.split()
    assert len(words) == 6
    assert decoded.token_ids == tuple(word_id(w) for w in words[:4])

    # The next turn re-sends the answer: its first 4 blocks are what the events reported, and hit.
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    ids2 = prompt_token_ids({"messages": turn2})
    assert ids2 is not None and ids2[:16] == list(prefill.token_ids + decoded.token_ids)
    await chat(http, ep.url, turn2, max_tokens=2)
    m = await metrics(http, ep.url)
    assert m["vllm:prefix_cache_queries_total"] == len(ids1) + len(ids2)
    assert m["vllm:prefix_cache_hits_total"] == 16
    _, seq, batch = await next_batch(sub)
    (more,) = batch.events
    assert seq == 2 and isinstance(more, BlockStored) and more.parent_block_hash == decoded.block_hashes[0]

    # vLLM's reset (POST, dev mode there): the cache is emptied and says so.
    async with http.post(ep.url + "/reset_prefix_cache") as r:
        assert r.status == 200 and await r.json() == {"success": True}
    _, seq, batch = await next_batch(sub)
    assert seq == 3 and batch.events == (AllBlocksCleared(),)
    # The counters count on over a reset, as vLLM's.
    assert (await metrics(http, ep.url))["vllm:prefix_cache_hits_total"] == 16
    await chat(http, ep.url, turn2, max_tokens=2)
    assert (await metrics(http, ep.url))["vllm:prefix_cache_hits_total"] == 16  # a miss after the reset
    async with http.get(ep.url + "/reset_prefix_cache") as r:
        assert r.status == 405


@pytest.mark.slow
async def test_a_cached_prompt_is_prefilled_faster_than_a_cold_one(
    engine: Callable[..., Awaitable[Listening]], http: aiohttp.ClientSession
) -> None:
    srv = await engine(ttft_ms=10, tokens_per_s=1000, prefill_tokens_per_s=2000, prefix_caching=True)
    e = srv.engine
    long_prompt = " ".join(f"word{i}" for i in range(800))
    msgs = [{"role": "user", "content": long_prompt}]

    async def timed(messages: list[dict[str, Any]], **extra: Any) -> tuple[float, float]:
        """The engine's own prefill time of one request, and the wall time it took."""
        s0, t0 = e.snapshot().prompt_seconds_total, time.monotonic()
        await chat(http, srv.url, messages, max_tokens=1, **extra)
        return e.snapshot().prompt_seconds_total - s0, time.monotonic() - t0

    cold, cold_wall = await timed(msgs)
    warm, warm_wall = await timed(msgs)
    # 802 tokens (a marker, 800 words, the generation prompt): 10 ms + 802 / 2000 s cold; warm,
    # 50 blocks of 16 are cached and 2 tokens computed.
    assert cold == pytest.approx(0.010 + 802 / 2000)
    assert warm == pytest.approx(0.010 + 2 / 2000)
    assert cold_wall >= 0.4 and warm_wall < cold_wall / 2
    m = await metrics(http, srv.url)
    assert m["vllm:prefix_cache_hits_total"] == 800
    # Another tenant's salt shares nothing: cold again.
    salted, _ = await timed(msgs, cache_salt="tenant-b")
    assert salted == pytest.approx(cold)
    streamed = {"model": MODEL, "messages": msgs, "max_tokens": 2, "stream": True, "cache_salt": "tenant-b"}
    t0 = time.monotonic()
    async with http.post(srv.url + "/v1/chat/completions", json=streamed) as r:
        first = await r.content.readline()
        first_s = time.monotonic() - t0
        rest = await r.read()
    assert first.startswith(b"data: ") and b"[DONE]" in rest
    assert first_s < cold_wall / 2  # the salted prompt's own blocks now hit


async def test_without_a_cache_nothing_is_tokenized_and_timing_is_as_before(
    engine: Callable[..., Awaitable[Listening]], http: aiohttp.ClientSession
) -> None:
    srv = await engine(ttft_ms=5, tokens_per_s=1000)
    assert srv.engine.cache is None
    msgs = [{"role": "user", "content": "a b c d e f g h i j k l m n o p q r"}]
    for _ in range(2):
        await chat(http, srv.url, msgs, max_tokens=1)
    snap = srv.engine.snapshot()
    assert snap.prompt_seconds_total == pytest.approx(0.010)
    m = await metrics(http, srv.url)
    assert m["vllm:prefix_cache_queries_total"] == 0 == m["vllm:prefix_cache_hits_total"]
    async with http.post(srv.url + "/reset_prefix_cache") as r:
        assert r.status == 404  # as vLLM outside dev mode


async def test_prefill_speed_without_a_cache_counts_every_prompt_token(
    engine: Callable[..., Awaitable[Listening]], http: aiohttp.ClientSession
) -> None:
    srv = await engine(ttft_ms=0, tokens_per_s=1000, prefill_tokens_per_s=10_000)
    await chat(http, srv.url, [{"role": "user", "content": " ".join(["x"] * 100)}], max_tokens=1)
    # The usage's 100 words, uncached: 10 ms.
    assert srv.engine.snapshot().prompt_seconds_total == pytest.approx(0.010)


@pytest.mark.slow
async def test_reset_is_refused_while_a_request_holds_blocks(
    engine: Callable[..., Awaitable[Listening]], http: aiohttp.ClientSession
) -> None:
    srv = await engine(ttft_ms=0, tokens_per_s=20, block_size=4, prefix_caching=True)
    body = {"model": MODEL, "prompt": "a b c d e f g h i", "max_tokens": 20}
    running = asyncio.create_task(http.post(srv.url + "/v1/completions", json=body))
    try:
        cache = srv.engine.cache
        assert cache is not None
        for _ in range(200):
            if cache.held:
                break
            await asyncio.sleep(0.005)
        assert cache.held == 2
        async with http.post(srv.url + "/reset_prefix_cache") as r:
            assert await r.json() == {"success": False}
        assert len(cache) == 2
        async with http.post(srv.url + "/reset_prefix_cache?reset_running_requests=true") as r:
            assert await r.json() == {"success": True}
        assert len(cache) == 0
    finally:
        resp = await running
        assert resp.status == 200
        json.loads(await resp.text())
        resp.release()
    # The request admitted before the reset leaves nothing behind.
    assert len(cache) == 0 and cache.held == 0


async def test_a_socket_that_cannot_be_bound_stops_the_start(sock_dir: Path) -> None:
    with pytest.raises(OSError, match="cannot bind the KV-event socket"):
        await start(SimOptions(port=0, kv_events_endpoint=f"ipc://{sock_dir}/no/such/dir/kv.sock"))


@pytest.mark.parametrize("salt", ["", "a/b", "x" * 129, "t@x", 5])
async def test_a_cache_salt_vllm_refuses_is_refused(
    engine: Callable[..., Awaitable[Listening]], http: aiohttp.ClientSession, salt: object
) -> None:
    srv = await engine(zero=True, prefix_caching=True)
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        async with http.post(srv.url + path, json={**body, "cache_salt": salt}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
        assert err["param"] == "body.cache_salt" and "Parameter 'cache_salt' must" in err["message"]
    assert srv.engine.cache is not None and srv.engine.cache.queries == 0


async def test_a_client_that_hangs_up_frees_its_blocks(
    engine: Callable[..., Awaitable[Listening]], http: aiohttp.ClientSession
) -> None:
    srv = await engine(ttft_ms=0, tokens_per_s=10, block_size=4, prefix_caching=True)
    cache = srv.engine.cache
    assert cache is not None
    body = {"model": MODEL, "prompt": "a b c d e f g h i", "max_tokens": 50, "stream": True}
    async with http.post(srv.url + "/v1/completions", json=body) as r:
        await r.content.readline()  # the prefill is done: its 2 blocks are cached and held
        assert cache.held == 2
        r.close()
    for _ in range(200):
        if cache.held == 0:
            break
        await asyncio.sleep(0.01)
    # Freed, still cached (evictable), and nothing of the unfinished answer was stored.
    assert cache.held == 0 and len(cache) == 2
