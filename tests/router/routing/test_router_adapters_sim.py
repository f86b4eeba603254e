"""LoRA adapters through a real router to real simulated engines (``llmgw sim-engine`` processes serving
adapters as vLLM 0.32 does): the answer through llmgw is the adapter's own (the engine's answer for
that adapter, not the base's); an engine whose report said it holds an adapter it has not answers its
real 404, and the request goes to one that has it; an adapter loaded nowhere is held until the engine
that loads it is reported. The load reports and wake replies are written by the test (no agent)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client as NATS

from llmgw_router.service import Router
from llmgw_runtime.natsserver import NatsServer
from llmgw_sim.options import SimOptions
from tests.kit.poll import eventually
from tests.router.router_helpers import RouterFactory, start_engine_process, stop_engine_processes
from tests.router.routing.test_router_adapters import Cluster, _chat, _post, _router

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture
def sims() -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    procs = [
        start_engine_process("m1", SimOptions(port=0, model="m1", zero=True, max_loras=2)) for _ in range(2)
    ]
    yield procs
    stop_engine_processes(procs)


async def _direct(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(url + path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)


async def _load(url: str, name: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        body = {"lora_name": name, "lora_path": f"/models/loras/{name}"}
        async with s.post(url + "/v1/load_lora_adapter", json=body) as resp:
            assert resp.status == 200, await resp.text()


def _text(body: Any) -> str:
    return str(body["choices"][0]["message"]["content"])


async def test_the_answer_through_llmgw_is_the_adapters_and_a_stale_holder_is_passed_over(
    nats_server: NatsServer,
    prefix: str,
    nc: NATS,
    routers: RouterFactory,
    sims: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    (_, e0), (_, e1) = sims
    await _load(e0, "a1")
    body = _chat("a1", "tell me about the sea", temperature=0)
    status, own = await _direct(e0, "/v1/chat/completions", body)
    assert status == 200
    status, base = await _direct(e0, "/v1/chat/completions", {**body, "model": "m1"})
    assert status == 200 and _text(base) != _text(own), "the engine's adapter answers as its base does"
    # e1 has not a1: its own 404, as vLLM's.
    status, err = await _direct(e1, "/v1/chat/completions", body)
    assert status == 404 and "a1" in err["error"]["message"]

    c = Cluster(nc, prefix)
    await c.catalog()
    v = await c.endpoints({"r0": e0, "r1": e1})
    await c.answer_wakes("ra")
    r: Router = await _router(routers, nats_server, prefix, v)
    # A report that is wrong about e1 (it says a1 is loaded there): the engine's 404 passes it over.
    await c.load({"r0": ("a1",), "r1": ("a1",)})
    await eventually(lambda: len(r.ctx.pool.holders("a1")) == 2, what="both said to hold a1")
    # Each request picks one of the two by load (even here): until one was sent to e1, at most 20.
    for _ in range(20):
        status, got = await _post(r, body)
        assert status == 200 and _text(got) == _text(own)
        if len(r.ctx.pool.holders("a1")) == 1:
            break
    assert [e.replica_id for e in r.ctx.pool.holders("a1")] == ["r0"]
    # The base through llmgw is the base.
    status, got = await _post(r, {**body, "model": "m1"})
    assert status == 200 and _text(got) == _text(base)

    # a2 loaded nowhere: held and asked for; loaded on e1 and reported, it is answered there, as a2.
    task = asyncio.create_task(_post(r, _chat("a2", "tell me about the sea", temperature=0)))
    await eventually(lambda: r.ctx.holding.held("a2") == 1, what="the a2 request held")
    await eventually(lambda: any(w.model == "a2" for w in c.wakes), what="a2 asked for")
    await _load(e1, "a2")
    await c.load({"r0": ("a1",), "r1": ("a2",)})
    status, got = await asyncio.wait_for(task, 15)
    status_direct, direct = await _direct(
        e1, "/v1/chat/completions", _chat("a2", "tell me about the sea", temperature=0)
    )
    assert status == 200 and status_direct == 200 and _text(got) == _text(direct)
    assert _text(got) not in (_text(own), _text(base))
