"""The simulated engine as real processes: faults that end it, SIGTERM, ports, and multi-node groups."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest

from llmgw_sim.engine import FAULT_EXIT_CODE
from llmgw_sim.options import SimOptions
from llmgw_sim.serving import Listening
from tests.kit.poll import eventually
from tests.sim.sim_testkit import EngineProcess

Spawn = Callable[[SimOptions], Awaitable[EngineProcess]]


async def status(http: aiohttp.ClientSession, url: str) -> int:
    try:
        async with http.get(url + "/health") as r:
            return r.status
    except aiohttp.ClientConnectionError:
        return -1


@pytest.mark.slow
async def test_exit_after_serves_n_requests_then_exits(engine_process: Spawn) -> None:
    ep = await engine_process(SimOptions(port=0, zero=True, exit_after=2))
    client = openai.AsyncOpenAI(base_url=ep.url + "/v1", api_key="x", max_retries=0)
    try:
        r1 = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "a"}]
        )
        r2 = await client.completions.create(model="sim-model", prompt="b", stream=True)
        text = "".join([c.choices[0].text async for c in r2 if c.choices])
        assert r1.choices[0].message.content and text
        assert await asyncio.wait_for(ep.proc.wait(), 10) == FAULT_EXIT_CODE
        with pytest.raises(openai.APIConnectionError):
            await client.models.list()
    finally:
        await client.close()
    assert "exit_after fault" in ep.log.read_text()


@pytest.mark.slow
async def test_sigterm_stops_cleanly_even_mid_request(
    engine_process: Spawn, http: aiohttp.ClientSession
) -> None:
    ep = await engine_process(SimOptions(port=0, ttft_ms=20_000))
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "a"}], "stream": True}
    async with http.post(ep.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200  # headers sent; the first token is 20 s away
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ep.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(ep.proc.wait(), 15) == 0
        assert loop.time() - t0 < 4  # aiohttp alone would wait out 2 x 5 s of grace
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()


@pytest.mark.slow
async def test_taken_port_is_refused_with_exit_1(engine: Callable[..., Awaitable[Listening]]) -> None:
    port = (await engine(zero=True)).port
    proc = await asyncio.create_subprocess_exec(
        *SimOptions(port=port).command(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in err.decode()
    assert b"listening" not in out


@pytest.mark.slow
async def test_leader_healthy_only_while_all_followers_beat(
    engine_process: Spawn, http: aiohttp.ClientSession
) -> None:
    hb = 0.2
    leader = await engine_process(SimOptions(port=0, world=3, heartbeat_s=hb, zero=True))
    addr = leader.url.removeprefix("http://")
    assert await status(http, leader.url) == 503
    async with http.post(leader.url + "/v1/completions", json={"model": "sim-model", "prompt": "x"}) as r:
        assert r.status == 503
        assert "rank(s) 1, 2" in (await r.json())["error"]["message"]

    f1 = await engine_process(SimOptions(port=0, rank=1, world=3, leader=addr, heartbeat_s=hb))
    await eventually(lambda: _is(http, f1.url, 200), timeout=10, what="follower 1 to join its leader")
    assert await status(http, leader.url) == 503  # rank 2 still missing
    f2 = await engine_process(SimOptions(port=0, rank=2, world=3, leader=addr, heartbeat_s=hb))
    await eventually(
        lambda: _is(http, leader.url, 200), timeout=10, what="the leader to be whole with both followers"
    )
    assert await status(http, f2.url) == 200
    # Followers serve /health only.
    async with http.get(f2.url + "/v1/models") as r:
        assert r.status == 404

    await f2.stop(signal.SIGKILL)
    await eventually(
        lambda: _is(http, leader.url, 503),
        timeout=5,
        what="the leader to turn unhealthy after a follower died",
    )
    async with http.get(leader.url + "/health") as r:
        assert "rank(s) 2" in (await r.json())["error"]["message"]

    # The leader going away takes its followers' health with it.
    await leader.stop()
    await eventually(
        lambda: _is(http, f1.url, 503), timeout=5, what="the follower to turn unhealthy without its leader"
    )


async def _is(http: aiohttp.ClientSession, url: str, code: int) -> bool:
    return await status(http, url) == code


# ---------------------------------------------------------------- joins, in process


async def test_join_endpoint_refuses_bad_bodies(
    engine: Callable[..., Awaitable[Listening]], http: aiohttp.ClientSession
) -> None:
    leader = await engine(world=2)
    async with http.post(leader.url + "/_sim/join", data=b"{nope") as r:
        assert r.status == 400
    async with http.post(leader.url + "/_sim/join", json={"rank": 1, "world": 5, "instance": "a"}) as r:
        assert r.status == 409
        assert "world 5" in (await r.json())["error"]["message"]
    assert await status(http, leader.url) == 503
    async with http.post(leader.url + "/_sim/join", json={"rank": 1, "world": 2, "instance": "a"}) as r:
        assert r.status == 200
    assert await status(http, leader.url) == 200


async def test_follower_of_a_mismatched_leader_stays_unready(
    engine: Callable[..., Awaitable[Listening]], http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    leader = await engine(world=2, heartbeat_s=0.05)
    addr = f"127.0.0.1:{leader.port}"
    wrong = await engine(rank=1, world=3, leader=addr, heartbeat_s=0.05)

    def refused() -> bool:
        return any("refused rank 1" in r.getMessage() for r in caplog.records)

    await eventually(refused, timeout=5, what="the follower to log the leader's refusal")
    assert await status(http, wrong.url) == 503
    assert await status(http, leader.url) == 503
    right = await engine(rank=1, world=2, leader=addr, heartbeat_s=0.05)
    await eventually(lambda: _is(http, right.url, 200), timeout=5, what="the matching follower to join")
    await eventually(lambda: _is(http, leader.url, 200), timeout=5, what="the leader to be whole")
    # Single-node engines have no join endpoint at all.
    single = await engine()
    async with http.post(single.url + "/_sim/join", json={}) as r:
        assert r.status == 404
