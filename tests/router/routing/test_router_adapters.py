"""LoRA adapters through a real router (issue 33): a real nats-server; the routing KV, the agents' load
reports and the control plane's wake replies written by the test; engines are real HTTP servers that
keep what they were sent (the kit's CountingUpstream, and a streaming one here that breaks on purpose).

What is checked: /v1/models lists adapters as vLLM does; a request for an adapter goes only to replicas
whose latest load report lists it, with the adapter's name as its model; one loaded nowhere is held and
asked for by name, and goes on when a report lists it; an adapter whose load failed, a refused wake and
a base with nothing coming are 503s that name the adapter and why; an engine's 404 for an adapter it was
said to hold is retried on a holder; keys, limits, usage and demand count the adapter by its name; its
prefix key is salted by its name; a broken stream is continued on a holder, as the adapter."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.catalog import AdapterProfile, Catalog, LoadTarget, ModelProfile
from llmgw_common.codec import decode, encode
from llmgw_common.kvcache import block_keys, request_salt
from llmgw_common.messages import (
    Endpoint,
    KeyLimits,
    Limits,
    LoadReport,
    ReplicaLoad,
    ReplicaSpec,
    RoutingCatalog,
    RoutingEndpoints,
)
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_common.subjects import Subjects
from llmgw_controlplane.scheduler.adapter_book import AdapterBook
from llmgw_controlplane.scheduler.adapter_reports import AdapterReports
from llmgw_controlplane.scheduler.demand import DemandBook
from llmgw_router.cache.router import text_units
from llmgw_router.demand import DemandMeter
from llmgw_router.service import Router
from llmgw_runtime import bus
from llmgw_runtime.apikeys import create_key
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.placement.placement_kit import node, replica, snap
from tests.router.router_helpers import CountingUpstream, RouterFactory

pytestmark = pytest.mark.slow

ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}


def _chat(model: str, text: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8, **kw}


class Cluster:
    """The routing KV as a control plane writes it, the agents' load reports, the wake replies."""

    def __init__(self, nc: NATS, prefix: str) -> None:
        self.nc, self.subjects, self.version = nc, Subjects(prefix), 0
        self.wakes: list[WakeRequest] = []
        self.reply = WakeState.WAKING
        self.reason = ""

    async def catalog(self, **base: Any) -> None:
        kv = await bus.ensure_kv(self.nc.jetstream(), self.subjects.bucket_routing)
        cat = Catalog(
            models=(ModelProfile(name="m1", engine="sim", max_loras=4, **base),),
            adapters=(
                AdapterProfile(name="a1", base="m1", weights="/models/loras/a1"),
                AdapterProfile(name="a2", base="m1", weights="/models/loras/a2", rank=8),
            ),
        )
        await kv.put("catalog", encode(RoutingCatalog(version=1, catalog=cat)))

    async def endpoints(self, urls: dict[str, str], **routing: Any) -> int:
        self.version += 1
        eps = tuple(Endpoint(replica_id=r, model="m1", url=u, node="n1") for r, u in urls.items())
        kv = await bus.ensure_kv(self.nc.jetstream(), self.subjects.bucket_routing)
        await kv.put(
            "endpoints",
            encode(RoutingEndpoints(version=self.version, endpoints={"m1": eps} if eps else {}, **routing)),
        )
        return self.version

    async def load(
        self, adapters: dict[str, tuple[str, ...]], errors: dict[str, dict[str, str]] | None = None
    ) -> None:
        """One agent's report: each replica's loaded adapters (and load errors)."""
        errors = errors or {}
        replicas = tuple(
            ReplicaLoad(replica_id=r, running=0, waiting=0, adapters=held, adapter_errors=errors.get(r, {}))
            for r, held in adapters.items()
        )
        await self.nc.publish(
            self.subjects.load("n1"), encode(LoadReport(node="n1", sent_at=time.time(), replicas=replicas))
        )
        await bus.flush(self.nc)

    async def answer_wakes(self, router_id: str) -> None:
        async def on_request(msg: Msg) -> None:
            req = decode(msg.data, WakeRequest)
            self.wakes.append(req)
            await msg.respond(encode(WakeReply(model=req.model, state=self.reply, reason=self.reason)))

        await self.nc.subscribe(self.subjects.wake(router_id), cb=on_request)
        await bus.flush(self.nc)


async def _router(
    routers: RouterFactory, nats_server: NatsServer, prefix: str, version: int, **kw: Any
) -> Router:
    kw.setdefault("auth", False)
    r: Router = await routers(nats_urls=[nats_server.url], prefix=prefix, router_id="ra", **kw)
    await asyncio.wait_for(r.synced.wait(), 10)
    h = r.ctx.holding
    h.stream_after_s, h.comment_every_s, h.wake_every_s, h.ask_timeout_s = 0.2, 0.2, 0.5, 1.0
    await eventually(lambda: r.ctx.pool.endpoints_version >= version, what="the router to read the endpoints")
    return r


async def _post(
    r: Router, body: dict[str, Any], path: str = "/v1/chat/completions", key: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(f"http://127.0.0.1:{r.port}{path}", json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)


async def _get(r: Router, path: str, key: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.get(f"http://127.0.0.1:{r.port}{path}", headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)


def _models(bodies: list[bytes]) -> list[str]:
    return [json.loads(b)["model"] for b in bodies]


@pytest.fixture
async def upstreams() -> AsyncIterator[list[CountingUpstream]]:
    ups = [CountingUpstream(200, answer=ANSWER) for _ in range(3)]
    for u in ups:
        await u.__aenter__()
    yield ups
    for u in ups:
        await u.__aexit__()


async def test_models_lists_adapters_with_parent_and_root_and_keys_see_their_own(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    c = Cluster(nc, prefix)
    await c.catalog()
    v = await c.endpoints({"r0": upstreams[0].url})
    r = await _router(routers, nats_server, prefix, v, auth=True)
    everything, _ = await create_key(nc, prefix, "all")
    only_a1, _ = await create_key(nc, prefix, "one", ["a1"])

    async def known(key: str) -> tuple[int, Any] | None:
        got = await _get(r, "/v1/models", key)
        return got if got[0] == 200 else None

    _, body = await eventually(lambda: known(everything), what="the first key to be known")
    await eventually(lambda: known(only_a1), what="the second key to be known")
    cards = {c["id"]: c for c in body["data"]}
    assert set(cards) == {"m1", "a1", "a2"}
    # As vLLM lists a LoRA adapter: root its weights, parent its base; the base has no parent.
    assert cards["a1"]["parent"] == "m1" and cards["a1"]["root"] == "/models/loras/a1"
    assert cards["a2"]["parent"] == "m1" and cards["a1"]["object"] == "model"
    assert cards["m1"].get("parent") is None
    # A key allowed one adapter sees it alone: not its base, not its sibling.
    status, body = await _get(r, "/v1/models", only_a1)
    assert status == 200 and [c["id"] for c in body["data"]] == ["a1"]
    status, card = await _get(r, "/v1/models/a1", only_a1)
    assert status == 200 and card["parent"] == "m1" and card["id"] == "a1"
    for name in ("a2", "m1", "nope"):
        status, err = await _get(r, f"/v1/models/{name}", only_a1)
        assert status == 404 and err["error"]["code"] == "model_not_found", name
    # And its requests: the base is not implied by the adapter.
    await c.load({"r0": ("a1", "a2")})
    await eventually(lambda: "a2" in r.ctx.pool.ready, what="the report to reach the router")
    assert (await _post(r, _chat("a1"), key=only_a1))[0] == 200
    for name in ("m1", "a2"):
        status, err = await _post(r, _chat(name), key=only_a1)
        assert status == 404 and err["error"]["code"] == "model_not_found", name


async def test_adapter_requests_go_only_to_replicas_whose_report_lists_it_with_its_name(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    c = Cluster(nc, prefix)
    await c.catalog(apis=("chat", "completions"))
    v = await c.endpoints({f"r{i}": u.url for i, u in enumerate(upstreams)})
    r = await _router(routers, nats_server, prefix, v)
    await c.load({"r0": (), "r1": ("a1",), "r2": ("a2",)})
    await eventually(lambda: {"a1", "a2"} <= r.ctx.pool.ready, what="the report to reach the router")
    for _ in range(12):
        assert (await _post(r, _chat("a1")))[0] == 200
    assert upstreams[0].hits == 0 and upstreams[2].hits == 0
    assert _models(upstreams[1].bodies) == ["a1"] * 12
    # The base's own requests still go anywhere; the completions API works for the adapter as well.
    for _ in range(12):
        assert (await _post(r, _chat("m1")))[0] == 200
    # (All twelve on r1 by chance: one time in half a million.)
    assert upstreams[0].hits + upstreams[2].hits > 0
    before = upstreams[2].hits
    status, _ = await _post(r, {"model": "a2", "prompt": "once upon", "max_tokens": 4}, "/v1/completions")
    assert status == 200 and upstreams[2].hits == before + 1
    assert json.loads(upstreams[2].bodies[-1]) == {"model": "a2", "prompt": "once upon", "max_tokens": 4}
    # A report that moves a1 to r0: the next requests follow it.
    await c.load({"r0": ("a1",), "r1": (), "r2": ("a2",)})
    await eventually(lambda: [e.replica_id for e in r.ctx.pool.holders("a1")] == ["r0"], what="a1 on r0")
    n0, n1 = upstreams[0].hits, upstreams[1].hits
    for _ in range(5):
        assert (await _post(r, _chat("a1")))[0] == 200
    assert upstreams[0].hits == n0 + 5 and upstreams[1].hits == n1
    # An API the base does not serve is the same 404 for the adapter, naming the adapter.
    status, err = await _post(r, {"model": "a1", "input": "x"}, "/v1/embeddings")
    assert status == 404 and err["error"]["code"] == "unsupported_endpoint"
    assert "'a1'" in err["error"]["message"]
    status, base_err = await _post(r, {"model": "m1", "input": "x"}, "/v1/embeddings")
    assert status == 404 and base_err["error"]["message"].replace("'m1'", "'a1'") == err["error"]["message"]


async def test_a_request_for_an_adapter_loaded_nowhere_is_held_asked_for_and_released_by_a_report(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    c = Cluster(nc, prefix)
    await c.catalog(replicas=1, max_replicas=3, target=LoadTarget(in_flight_per_replica=4))
    v = await c.endpoints({"r0": upstreams[0].url, "r1": upstreams[1].url})
    await c.answer_wakes("ra")
    r = await _router(routers, nats_server, prefix, v)
    plain = asyncio.create_task(_post(r, _chat("a1")))
    streamed = asyncio.create_task(_stream_text(r, _chat("a1", stream=True)))
    await eventually(lambda: r.ctx.holding.held("a1") == 2, what="both requests to be held")
    await eventually(lambda: c.wakes, what="the router to ask for the adapter")
    assert {(w.model, w.router) for w in c.wakes} == {("a1", "ra")}
    # Held, not sent: no engine has it.
    await asyncio.sleep(0.5)
    assert not plain.done() and upstreams[0].hits == upstreams[1].hits == 0
    # The demand report counts the held requests under the adapter's name, and in its base's total.
    demand = r.demand.report("ra", time.time()).models
    assert demand["a1"].held == 2 and demand["m1"].held == 2 and demand["a2"].held == 0
    assert demand["a1"].replicas_reporting == 0
    await c.load({"r0": (), "r1": ("a1",)})
    status, body = await asyncio.wait_for(plain, 10)
    assert status == 200 and body["choices"][0]["message"]["content"] == "ok"
    text = await asyncio.wait_for(streamed, 10)
    # The held stream got its comments while the adapter loaded, then the engine's answer.
    assert ": loading adapter a1" in text and '"ok"' in text
    assert _models(upstreams[1].bodies) == ["a1", "a1"] and upstreams[0].hits == 0
    assert r.ctx.holding.held("a1") == 0


async def _stream_text(r: Router, body: dict[str, Any]) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            return (await resp.read()).decode()


async def test_an_adapter_whose_load_failed_is_a_503_naming_it_and_why_held_ones_too(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    c = Cluster(nc, prefix)
    await c.catalog()
    v = await c.endpoints({"r0": upstreams[0].url})
    await c.answer_wakes("ra")
    r = await _router(routers, nats_server, prefix, v)
    held = asyncio.create_task(_post(r, _chat("a2")))
    await eventually(lambda: r.ctx.holding.held("a2") == 1, what="the request to be held")
    why = "adapter weights /models/loras/a2 not found on node n1"
    await c.load({"r0": ()}, {"r0": {"a2": why}})
    status, body = await asyncio.wait_for(held, 10)
    assert status == 503
    msg = body["error"]["message"]
    assert "'a2'" in msg and why in msg
    # Now, at once, without holding (and without asking again).
    asked = len(c.wakes)
    t0 = time.monotonic()
    status, body = await _post(r, _chat("a2"))
    assert status == 503 and why in body["error"]["message"] and time.monotonic() - t0 < 2.0
    assert len(c.wakes) == asked and upstreams[0].hits == 0
    # Another adapter of the same base is not concerned.
    await c.load({"r0": ("a1",)}, {"r0": {"a2": why}})
    await eventually(lambda: "a1" in r.ctx.pool.ready, what="a1 loaded")
    assert (await _post(r, _chat("a1")))[0] == 200


async def test_a_refused_wake_and_a_base_with_nothing_coming_are_503s_naming_the_adapter(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    c = Cluster(nc, prefix)
    await c.catalog()
    v = await c.endpoints({"r0": upstreams[0].url})
    c.reply, c.reason = WakeState.REFUSED, "every replica of m1 holds 4 adapters with requests in flight"
    await c.answer_wakes("ra")
    r = await _router(routers, nats_server, prefix, v)
    status, body = await _post(r, _chat("a1"))
    assert status == 503
    assert body["error"]["message"] == (
        "adapter 'a1' (of model 'm1') cannot be loaded: every replica of m1 holds 4 adapters with "
        "requests in flight"
    )
    assert [w.model for w in c.wakes] == ["a1"]
    # The base gone, nothing coming: refused at once with the base's reason, no wake asked.
    v = await c.endpoints({}, unavailable={"m1": "needs 1 x A100, none free"})
    await eventually(lambda: r.ctx.pool.endpoints_version >= v, what="the new endpoints")
    status, body = await _post(r, _chat("a2"))
    assert status == 503
    assert (
        body["error"]["message"] == "adapter 'a2': model 'm1' has no ready replica: needs 1 x A100, none free"
    )
    assert [w.model for w in c.wakes] == ["a1"]


async def test_an_engine_that_says_404_for_an_adapter_it_was_said_to_hold_is_passed_over(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    async with CountingUpstream(404, "The model `a1` does not exist.") as stale:
        c = Cluster(nc, prefix)
        await c.catalog()
        v = await c.endpoints({"r0": stale.url, "r1": upstreams[1].url})
        await c.answer_wakes("ra")
        r = await _router(routers, nats_server, prefix, v)
        await c.load({"r0": ("a1",), "r1": ("a1",)})
        await eventually(lambda: len(r.ctx.pool.holders("a1")) == 2, what="both holders")
        for _ in range(6):
            assert (await _post(r, _chat("a1")))[0] == 200
        # r0 was asked at most once: its 404 made it no holder until its next report.
        assert stale.hits <= 1 and upstreams[1].hits == 6
        assert [e.replica_id for e in r.ctx.pool.holders("a1")] == ["r1"]
        # When the only replica said to hold it has it not, the request is held and the adapter asked
        # for, not failed; a report that lists it on r1 sends it there.
        await c.load({"r0": ("a1",), "r1": ()})
        await eventually(
            lambda: [e.replica_id for e in r.ctx.pool.holders("a1")] == ["r0"], what="a1 on r0 only"
        )
        hits = stale.hits
        task = asyncio.create_task(_post(r, _chat("a1")))
        await eventually(lambda: r.ctx.holding.held("a1") == 1, what="the request held again")
        assert stale.hits == hits + 1 and c.wakes and c.wakes[-1].model == "a1"
        await c.load({"r0": (), "r1": ("a1",)})
        status, _ = await asyncio.wait_for(task, 10)
        assert status == 200 and upstreams[1].hits == 7


async def test_keys_limits_usage_and_demand_count_the_adapter_by_its_name(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    c = Cluster(nc, prefix)
    await c.catalog(replicas=1, max_replicas=3, target=LoadTarget(in_flight_per_replica=4))
    v = await c.endpoints({"r0": upstreams[0].url})
    r = await _router(routers, nats_server, prefix, v, auth=True)
    key, rec = await create_key(
        nc, prefix, "tuned", ["a1", "m1"], limits=KeyLimits(models={"a1": Limits(rpm=2)})
    )
    await c.load({"r0": ("a1",)})
    await eventually(lambda: "a1" in r.ctx.pool.ready, what="a1 loaded")

    async def known() -> bool:
        return (await _post(r, _chat("m1"), key=key))[0] == 200

    await eventually(known, what="the key to be known")
    # The adapter's own limit: 2 a minute for a1, the base untouched by it.
    assert (await _post(r, _chat("a1"), key=key))[0] == 200
    assert (await _post(r, _chat("a1"), key=key))[0] == 200
    status, err = await _post(r, _chat("a1"), key=key)
    assert status == 429 and err["error"]["code"] == "rate_limit_exceeded"
    assert (await _post(r, _chat("m1"), key=key))[0] == 200
    usage = r.ctx.usage.report("ra", time.time()).usage[rec.id]
    assert usage["a1"] == (2, 10, 4)
    assert usage["m1"][0] == 2
    # Demand: the adapter's own entry, and the base's the whole load on its replicas.
    report = r.demand.report("ra", time.time())
    assert report.models["a1"].completed == 3  # two answered, one refused
    assert report.models["m1"].completed == 3 + 2
    assert report.models["a1"].replicas_reporting == 1 and report.models["a1"].running is None
    assert "a2" in report.models and report.models["a2"].completed == 0


async def test_the_prefix_key_of_an_adapter_is_salted_by_its_name(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    c = Cluster(nc, prefix)
    await c.catalog(cache_routing="approximate")
    v = await c.endpoints({"r0": upstreams[0].url, "r1": upstreams[1].url})
    r = await _router(routers, nats_server, prefix, v)
    await c.load({"r0": ("a1",), "r1": ()})
    await eventually(lambda: "a1" in r.ctx.pool.ready, what="a1 loaded")
    body = _chat("a1", "a long enough prompt to fill a few blocks of the approximate index " * 4)
    assert (await _post(r, body))[0] == 200
    assert r.ctx.cache is not None
    cache = r.ctx.cache
    per = cache.limits.approx_text_block_bytes // 4
    units = text_units(body)
    assert units is not None
    salted = block_keys(units, per, request_salt("a1", None))
    plain = block_keys(units, per, request_salt(None, None))
    now = time.time()
    # Recorded on the base's index, under the adapter's salt: the base's own prompt does not match it.
    assert cache.approx.match("m1", salted, now) == {"r0": len(salted)}
    assert cache.approx.match("m1", plain, now) == {}


# ---------------------------------------------------------------- a stream continued as the adapter


class StreamingEngine:
    """A real HTTP server streaming chat chunks; ``cut``: two events, then the connection dropped."""

    def __init__(self, cut: bool) -> None:
        self.cut = cut
        self.bodies: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    @staticmethod
    def event(content: str, finish: str | None = None) -> bytes:
        chunk = {
            "id": "chatcmpl-s",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "a1",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.cut:
            await resp.write(self.event("Hello") + self.event(" wor"))
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write(self.event("ld", "stop") + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> StreamingEngine:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def test_a_stream_broken_mid_way_is_continued_on_a_holder_as_the_adapter(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    async with StreamingEngine(cut=True) as first, StreamingEngine(cut=False) as rest:
        c = Cluster(nc, prefix)
        await c.catalog()
        # r2 is the base's too, lighter than anyone, but without the adapter: never the continuation's.
        v = await c.endpoints({"r0": first.url, "r1": rest.url, "r2": upstreams[2].url})
        r = await _router(routers, nats_server, prefix, v)
        await c.load({"r0": ("a1",), "r1": ("a1",), "r2": ()})
        await eventually(lambda: len(r.ctx.pool.holders("a1")) == 2, what="both holders")
        # r1 busy in this router's eyes: the first attempt goes to r0, which breaks.
        r.ctx.pool.by_replica["r1"][0].in_flight = 50
        text = await _stream_text(r, _chat("a1", stream=True))
        r.ctx.pool.by_replica["r1"][0].in_flight = 0
        assert len(first.bodies) == 1 and len(rest.bodies) == 1 and upstreams[2].hits == 0
        cont = rest.bodies[0]
        assert cont["model"] == "a1" and cont["continue_final_message"] is True
        assert cont["messages"][-1] == {"role": "assistant", "content": "Hello wor"}
        contents = [
            json.loads(line[6:])["choices"][0]["delta"].get("content", "")
            for line in text.split("\n")
            if line.startswith("data: {")
        ]
        assert "".join(contents) == "Hello world" and text.rstrip().endswith("data: [DONE]")
        assert r.ctx.metrics.migrations_count("a1", "ok") == 1


async def test_a_load_that_never_comes_ends_in_a_503_naming_the_adapter_and_what_was_awaited(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    c = Cluster(nc, prefix)
    await c.catalog(wake_timeout_s=1.0)
    v = await c.endpoints({"r0": upstreams[0].url})
    r = await _router(routers, nats_server, prefix, v)
    # No control plane answers: said so after the base's wake_timeout_s.
    status, body = await _post(r, _chat("a1"))
    assert status == 503
    assert body["error"]["message"] == (
        "adapter 'a1' (of model 'm1') is not loaded and the control plane did not answer the request to "
        "load it within 1s"
    )
    # One answers "waking" and no replica ever reports it loaded.
    await c.answer_wakes("ra")
    status, body = await _post(r, _chat("a2"))
    assert status == 503
    assert body["error"]["message"] == "adapter 'a2' (of model 'm1') was not loaded within 1s"
    assert [w.model for w in c.wakes] and {w.model for w in c.wakes} == {"a2"}
    assert upstreams[0].hits == 0


async def test_demand_counts_an_adapters_requests_in_flight_and_queued_under_its_name_and_its_bases(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await release.wait()
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_post("/{tail:.*}", slow)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        c = Cluster(nc, prefix)
        # One request at a time through the base's gate: the second waits in it.
        await c.catalog(
            replicas=1, max_replicas=3, target=LoadTarget(in_flight_per_replica=4), max_concurrency=1
        )
        v = await c.endpoints({"r0": f"http://{host}:{port}"})
        r = await _router(routers, nats_server, prefix, v)
        await c.load({"r0": ("a1",)})
        await eventually(lambda: "a1" in r.ctx.pool.ready, what="a1 loaded")
        first = asyncio.create_task(_post(r, _chat("a1")))
        second = asyncio.create_task(_post(r, _chat("a1")))
        gate = r.ctx.gates.by_model
        await eventually(lambda: "m1" in gate and gate["m1"].queued == 1, what="one in flight, one queued")
        demand = r.demand.report("ra", time.time()).models
        assert (demand["a1"].in_flight, demand["a1"].queued) == (1, 1)
        assert (demand["m1"].in_flight, demand["m1"].queued) == (1, 1)
        assert (demand["a2"].in_flight, demand["a2"].queued) == (0, 0)
        release.set()
        assert [s for s, _ in await asyncio.gather(first, second)] == [200, 200]
        demand = r.demand.report("ra", time.time()).models
        assert (demand["a1"].in_flight, demand["a1"].queued, demand["m1"].in_flight) == (0, 0, 0)
        assert demand["a1"].completed == 2 and demand["m1"].completed == 2
    finally:
        release.set()
        await runner.cleanup()


async def test_adapters_of_a_base_without_a_load_target_are_reported_and_a_hot_one_spreads(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, upstreams: list[CountingUpstream]
) -> None:
    """The control plane keeps a busy adapter loaded, orders the LRU by arrivals and spreads a hot adapter
    from its own demand entry: a base that does not follow load (no ``target``) needs them as much. The
    router's report goes through the control plane's own demand book and adapter decision (pure)."""
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await release.wait()
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_post("/{tail:.*}", slow)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    tasks: list[asyncio.Task[tuple[int, Any]]] = []
    try:
        c = Cluster(nc, prefix)
        await c.catalog()  # no target: the base does not follow load
        v = await c.endpoints({"r0": f"http://{host}:{port}", "r1": upstreams[1].url})
        r = await _router(routers, nats_server, prefix, v)
        await c.load({"r0": ("a1",), "r1": ("a2",)})
        await eventually(lambda: "a1" in r.ctx.pool.ready, what="a1 loaded")
        # A meter of the test's own, its first mark before any request (the router's own ticks too).
        meter = DemandMeter(r.ctx)
        meter.report("ra", time.time())
        # A short request on a2: seen as an arrival (the LRU order's "used"), nothing outstanding.
        assert (await _post(r, _chat("a2")))[0] == 200
        tasks = [asyncio.create_task(_post(r, _chat("a1"))) for _ in range(9)]
        await eventually(lambda: r.ctx.metrics.adapter_in_flight.get("a1", 0) == 9, what="9 in flight on a1")
        now = time.time()
        report = meter.report("ra", now)
        assert (report.models["a1"].in_flight, report.models["a1"].replicas_reporting) == (9, 1)
        assert (report.models["a2"].arrived, report.models["a2"].completed) == (1, 1)
        assert report.models["a2"].in_flight == 0
        # The control plane: 9 requests on the one replica holding a1, above spread_per_replica (8).
        base = ModelProfile(name="m1", engine="sim", max_loras=4)
        cat = Catalog(
            models=(base,),
            adapters=(
                AdapterProfile(name="a1", base="m1", weights="/models/loras/a1"),
                AdapterProfile(name="a2", base="m1", weights="/models/loras/a2"),
            ),
        )
        spec = ReplicaSpec.of(base)
        s = replace(
            snap(
                [node("n1", 0), node("n2", 0)],
                [replica("r0", "m1", [("n1", ())], spec=spec), replica("r1", "m1", [("n2", ())], spec=spec)],
                [base],
                now=now,
            ),
            catalog=cat,
        )
        demand = DemandBook(stale_s=10.0)
        demand.add(report, now)
        book = AdapterBook(AdapterReports(stale_s=10.0))
        lines = (
            ReplicaLoad(replica_id="r0", adapters=("a1",)),
            ReplicaLoad(replica_id="r1", adapters=("a2",)),
        )
        book.reports.add(LoadReport(node="n1", sent_at=now, replicas=lines[:1]), now)
        book.reports.add(LoadReport(node="n2", sent_at=now, replicas=lines[1:]), now)
        d = book.decide(s, demand.merged(now), lambda: {"r0": ("a1",), "r1": ("a2",)})
        assert dict(d.assigned) == {"r0": ("a1",), "r1": ("a2", "a1")}
        assert [(m.adapter, m.replica_id) for m in d.loads] == [("a1", "r1")]
        assert "9 requests over 1 replica(s), above 8 each" in d.loads[0].why
        # The rise in a2's arrivals marked it used just now.
        assert d.memo.used["a2"] == now
    finally:
        release.set()
        for t in tasks:
            await t
        await runner.cleanup()
