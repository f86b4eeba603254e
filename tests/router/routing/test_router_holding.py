"""Requests held, not refused, while a replica is coming or a cold model wakes (issues 13 and 14).

Real nats-server; the routing KV is written by the test; the control plane is a NATS responder written
here that answers WakeRequest; engines are real (a sim engine process for the burst).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import decode, encode
from llmgw_common.messages import Endpoint, RoutingCatalog, RoutingEndpoints
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_common.subjects import Subjects
from llmgw_router.service import Router
from llmgw_router.tenancy.admission import AdmissionRefused, Gate
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, RouterFactory, start_engine_process

CHAT: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Routing:
    """The routing KV as a control plane would write it: catalog once, then endpoint updates."""

    def __init__(self, nc: NATS, prefix: str) -> None:
        self.nc, self.prefix, self.version = nc, prefix, 0

    async def catalog(self, **profile: Any) -> None:
        kv = await bus.ensure_kv(self.nc.jetstream(), Subjects(self.prefix).bucket_routing)
        cat = Catalog(models=(ModelProfile(name="m1", engine="sim", **profile),))
        await kv.put("catalog", encode(RoutingCatalog(version=1, catalog=cat)))

    async def endpoints(
        self,
        urls: tuple[str, ...] = (),
        *,
        coming: dict[str, str] | None = None,
        cold: tuple[str, ...] = (),
        unavailable: dict[str, str] | None = None,
        draining: bool = False,
    ) -> None:
        self.version += 1
        eps = tuple(
            Endpoint(replica_id=f"r{i}", model="m1", url=u, node="n1", draining=draining)
            for i, u in enumerate(urls)
        )
        kv = await bus.ensure_kv(self.nc.jetstream(), Subjects(self.prefix).bucket_routing)
        value = RoutingEndpoints(
            version=self.version,
            endpoints={"m1": eps} if eps else {},
            unavailable=unavailable or {},
            coming=coming or {},
            cold=cold,
        )
        await kv.put("endpoints", encode(value))


class FakeControlPlane:
    """A real responder on the router's wake subject: records each WakeRequest and how many were
    unanswered at once; answers ``state`` after ``delay_s``."""

    def __init__(self, state: WakeState, reason: str = "", delay_s: float = 0.0) -> None:
        self.state, self.reason, self.delay_s = state, reason, delay_s
        self.asked: list[WakeRequest] = []
        self.open = 0
        self.max_open = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def on_request(self, msg: Msg) -> None:
        self.asked.append(decode(msg.data, WakeRequest))
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        t = asyncio.create_task(self._answer(msg))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        await asyncio.sleep(self.delay_s)
        self.open -= 1
        await msg.respond(encode(WakeReply(model="m1", state=self.state, reason=self.reason)))


async def _control_plane(nc: NATS, prefix: str, router_id: str, cp: FakeControlPlane) -> None:
    await nc.subscribe(Subjects(prefix).wake(router_id), cb=cp.on_request)
    await bus.flush(nc)


async def _router(routers: RouterFactory, nats_url: str, prefix: str, **timing: float) -> Router:
    r: Router = await routers(nats_urls=[nats_url], prefix=prefix, auth=False, router_id="rh")
    await asyncio.wait_for(r.synced.wait(), 10)
    h = r.ctx.holding
    h.stream_after_s = timing.get("stream_after_s", 0.2)
    h.comment_every_s = timing.get("comment_every_s", 0.2)
    h.wake_every_s = timing.get("wake_every_s", 0.5)
    h.ask_timeout_s = timing.get("ask_timeout_s", 0.5)
    return r


def _gauge(r: Router, name: str, model: str = "m1") -> float | None:
    text = r.ctx.metrics.exposition().decode()
    m = re.search(rf'^{name}{{model="{model}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def _held(r: Router) -> float | None:
    return _gauge(r, "llmgw_router_held")


async def _post(url: str, body: dict[str, Any], timeout: float = 30.0) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(url, json=body) as resp:
            return resp.status, await resp.json(content_type=None)


async def _wait_synced(r: Router, version: int) -> None:
    await eventually(
        lambda: r.ctx.pool.endpoints_version >= version,
        timeout=10.0,
        what="the router to apply the new endpoints version",
    )


@pytest.fixture
def engine_process() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if p.stdout:
            p.stdout.close()


@pytest.mark.slow
async def test_burst_for_a_cold_model_makes_one_wake_in_flight_and_all_are_answered(
    nats_server: NatsServer,
    prefix: str,
    nc: NATS,
    routers: RouterFactory,
    engine_process: list[subprocess.Popen[bytes]],
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog()
    await routing.endpoints(cold=("m1",), unavailable={"m1": "scaled to zero"})
    cp = FakeControlPlane(WakeState.WAKING, delay_s=0.3)
    await _control_plane(nc, prefix, "rh", cp)
    # The ask's timeout well above the answer's delay: a late answer on a busy box is not a second ask.
    r = await _router(routers, nats_server.url, prefix, ask_timeout_s=3.0)
    await _wait_synced(r, 1)
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    clients = [asyncio.create_task(_post(url, CHAT)) for _ in range(20)]
    await eventually(lambda: _held(r) == 20, timeout=10.0, what="all 20 requests to be held")
    # Held for a while: the router re-asks (a leader change may lose a wake), one at a time.
    await eventually(
        lambda: len(cp.asked) >= 2, timeout=10.0, what="the router to ask the control plane twice"
    )
    proc, eng_url = await asyncio.to_thread(start_engine_process, "m1")
    engine_process.append(proc)
    await routing.endpoints((eng_url,))
    answers = await asyncio.gather(*clients)
    assert [st for st, _ in answers] == [200] * 20
    assert cp.max_open == 1
    assert {(a.model, a.router) for a in cp.asked} == {("m1", "rh")}
    assert _held(r) == 0
    text = r.ctx.metrics.exposition().decode()
    assert 'llmgw_router_hold_seconds_count{model="m1"} 20.0' in text


async def test_refused_wake_answers_503_with_the_control_planes_reason(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog()
    await routing.endpoints(cold=("m1",))
    reason = "needs 1 x A100 with 80 GB, none free (3 nodes checked)"
    cp = FakeControlPlane(WakeState.REFUSED, reason=reason)
    await _control_plane(nc, prefix, "rh", cp)
    r = await _router(routers, nats_server.url, prefix)
    await _wait_synced(r, 1)
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    answers = await asyncio.gather(*(_post(url, CHAT) for _ in range(3)))
    for status, body in answers:
        assert status == 503 and reason in body["error"]["message"]
    assert _held(r) == 0


@pytest.mark.slow
async def test_no_control_plane_answer_gives_503_after_the_wake_timeout(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog(wake_timeout_s=1.0)
    await routing.endpoints(cold=("m1",))
    r = await _router(routers, nats_server.url, prefix)
    await _wait_synced(r, 1)
    t0 = time.monotonic()
    status, body = await _post(f"http://127.0.0.1:{r.port}/v1/chat/completions", CHAT)
    assert status == 503
    assert "the control plane did not answer the wake request" in body["error"]["message"]
    assert time.monotonic() - t0 >= 1.0


@pytest.mark.slow
async def test_a_control_plane_that_never_answers_is_asked_again_until_the_wake_timeout(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog(wake_timeout_s=2.0)
    await routing.endpoints(cold=("m1",))
    asked: list[float] = []

    async def silent(msg: Msg) -> None:  # hears the request, never answers (a leader that hangs)
        asked.append(time.monotonic())

    await nc.subscribe(Subjects(prefix).wake("rh"), cb=silent)
    await bus.flush(nc)
    r = await _router(routers, nats_server.url, prefix, ask_timeout_s=0.3, wake_every_s=0.2)
    await _wait_synced(r, 1)
    status, body = await _post(f"http://127.0.0.1:{r.port}/v1/chat/completions", CHAT)
    assert status == 503
    assert "the control plane did not answer the wake request within 2s" in body["error"]["message"]
    # One at a time: each ask begins after the previous one's timeout (0.3 s) and the pause (0.2 s), so
    # the 2 s hold has room for at most 5; asks sent without waiting would be 10 or more. Counted, not
    # timed: when this process's loop stalled, two asks reached it under 0.45 s apart (a CI run).
    assert 3 <= len(asked) <= 5, asked


@pytest.mark.slow
async def test_held_past_queue_timeout_gets_503_naming_what_was_coming(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog(queue_timeout_s=1.0)
    await routing.endpoints(coming={"m1": "replica r7 starting on node n4"})
    r = await _router(routers, nats_server.url, prefix)
    await _wait_synced(r, 1)
    t0 = time.monotonic()
    status, body = await _post(f"http://127.0.0.1:{r.port}/v1/chat/completions", CHAT)
    assert status == 503
    msg = body["error"]["message"]
    assert "replica r7 starting on node n4" in msg and "within 1s" in msg
    assert time.monotonic() - t0 >= 1.0


async def test_nothing_coming_is_refused_at_once(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog(queue_timeout_s=30.0)
    await routing.endpoints(unavailable={"m1": "placement failing: needs 2 GPUs"})
    r = await _router(routers, nats_server.url, prefix)
    await _wait_synced(r, 1)
    t0 = time.monotonic()
    status, body = await _post(f"http://127.0.0.1:{r.port}/v1/chat/completions", CHAT)
    assert status == 503 and "needs 2 GPUs" in body["error"]["message"]
    assert time.monotonic() - t0 < 5.0


async def test_held_requests_end_when_the_routing_says_nothing_is_coming_any_more(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog(queue_timeout_s=60.0)
    await routing.endpoints(coming={"m1": "replica r1 starting"})
    r = await _router(routers, nats_server.url, prefix)
    await _wait_synced(r, 1)
    client = asyncio.create_task(_post(f"http://127.0.0.1:{r.port}/v1/chat/completions", CHAT))
    await eventually(lambda: _held(r) == 1, timeout=10.0, what="one request to be held")
    await routing.endpoints(unavailable={"m1": "replica r1 failed: out of memory"})
    status, body = await asyncio.wait_for(client, 10.0)
    assert status == 503 and "out of memory" in body["error"]["message"]


async def test_all_endpoints_draining_with_a_replacement_coming_is_held_until_it_serves(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, engines: EngineFactory
) -> None:
    eng = await engines("m1")
    routing = Routing(nc, prefix)
    await routing.catalog(queue_timeout_s=30.0)
    await routing.endpoints((eng.url,), draining=True, coming={"m1": "replacement r9 starting"})
    r = await _router(routers, nats_server.url, prefix)
    await _wait_synced(r, 1)
    client = asyncio.create_task(_post(f"http://127.0.0.1:{r.port}/v1/chat/completions", CHAT))
    await eventually(lambda: _held(r) == 1, timeout=10.0, what="one request to be held")
    await routing.endpoints((eng.url,))
    status, _ = await asyncio.wait_for(client, 10.0)
    assert status == 200


async def test_before_any_routing_table_a_catalog_model_is_held_and_served_by_the_first_table(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, engines: EngineFactory
) -> None:
    # A cluster coming up: the router has the catalog before any control plane led and wrote a table.
    # Its requests wait for the first table instead of a 503 (`docker compose up` answered ten of them).
    eng = await engines("m1")
    routing = Routing(nc, prefix)
    await routing.catalog(queue_timeout_s=30.0)
    r = await _router(routers, nats_server.url, prefix)
    assert not r.ctx.pool.table_read
    client = asyncio.create_task(_post(f"http://127.0.0.1:{r.port}/v1/chat/completions", CHAT))
    await eventually(lambda: _held(r) == 1, timeout=10.0, what="one request to be held")
    await routing.endpoints((eng.url,))
    status, _ = await asyncio.wait_for(client, 10.0)
    assert status == 200


async def test_no_routing_table_within_the_queue_timeout_is_a_503_that_says_so(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog(queue_timeout_s=1.0)
    r = await _router(routers, nats_server.url, prefix)
    t0 = time.monotonic()
    status, body = await _post(f"http://127.0.0.1:{r.port}/v1/chat/completions", CHAT)
    assert status == 503
    assert "no control plane published a routing table within 1s" in body["error"]["message"]
    assert time.monotonic() - t0 >= 1.0
    # An unknown model is still refused at once: only the catalog's models are held.
    status, body = await _post(f"http://127.0.0.1:{r.port}/v1/chat/completions", {**CHAT, "model": "nope"})
    assert status == 404


async def test_held_requests_are_bounded_by_max_queue_and_a_client_that_leaves_frees_its_place(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog(max_queue=2, queue_timeout_s=60.0)
    await routing.endpoints(coming={"m1": "replica r1 starting"})
    r = await _router(routers, nats_server.url, prefix)
    await _wait_synced(r, 1)
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    staying = asyncio.create_task(_post(url, CHAT, timeout=60.0))
    leaving = asyncio.create_task(_post(url, CHAT, timeout=60.0))
    await eventually(lambda: _held(r) == 2, timeout=10.0, what="two requests to be held")
    status, body = await _post(url, CHAT)
    assert status == 429 and "queue of 2" in body["error"]["message"]
    leaving.cancel()  # the client hangs up
    await eventually(lambda: _held(r) == 1, timeout=10.0, what="one request to be held")
    again = asyncio.create_task(_post(url, CHAT, timeout=60.0))
    await eventually(lambda: _held(r) == 2, timeout=10.0, what="two requests to be held")
    staying.cancel()
    again.cancel()
    await eventually(lambda: _held(r) == 0, timeout=10.0, what="no request to be held")


@pytest.mark.slow
async def test_a_held_stream_gets_sse_comments_before_its_first_token(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, engines: EngineFactory
) -> None:
    eng = await engines("m1")
    routing = Routing(nc, prefix)
    await routing.catalog(wake_timeout_s=60.0)
    await routing.endpoints(cold=("m1",))
    cp = FakeControlPlane(WakeState.WAKING)
    await _control_plane(nc, prefix, "rh", cp)
    r = await _router(routers, nats_server.url, prefix, stream_after_s=0.2, comment_every_s=0.2)
    await _wait_synced(r, 1)
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10.0)
            second = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10.0)
            assert first == second == b": waking model m1\n\n"
            await routing.endpoints((eng.url,))
            rest = await asyncio.wait_for(resp.content.read(), 10.0)
    events = [e for e in rest.split(b"\n\n") if e]
    data = [e for e in events if e.startswith(b"data: ")]
    assert data[-1] == b"data: [DONE]" and any(b'"content"' in e for e in data)
    assert all(e == b": waking model m1" for e in events if not e.startswith(b"data: "))


async def test_a_held_stream_whose_client_leaves_after_the_first_comment_frees_its_place(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    routing = Routing(nc, prefix)
    await routing.catalog(queue_timeout_s=60.0)
    await routing.endpoints(coming={"m1": "replica r1 starting"})
    r = await _router(routers, nats_server.url, prefix, stream_after_s=0.1, comment_every_s=0.1)
    await _wait_synced(r, 1)
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json={**CHAT, "stream": True}) as resp:
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10.0)
        assert first == b": waiting for model m1\n\n" and _held(r) == 1
    await eventually(lambda: _held(r) == 0, timeout=10.0, what="no request to be held")
    await eventually(
        lambda: r.ctx.metrics.requests_count("m1", 499) == 1,
        timeout=10.0,
        what="the router to count the departed client's request as 499",
    )


async def _refused_cold_stream(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, path: str, body: dict[str, Any]
) -> tuple[Router, list[bytes]]:
    """A stream held for a cold model whose wake the control plane refuses after the stream began:
    the router, and the SSE events the client received."""
    routing = Routing(nc, prefix)
    await routing.catalog()
    await routing.endpoints(cold=("m1",))
    cp = FakeControlPlane(WakeState.REFUSED, reason="no node has 80 GB free", delay_s=0.8)
    await _control_plane(nc, prefix, "rh", cp)
    r = await _router(
        routers, nats_server.url, prefix, stream_after_s=0.1, comment_every_s=0.2, ask_timeout_s=5.0
    )
    await _wait_synced(r, 1)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{r.port}{path}", json=body) as resp:
            assert resp.status == 200
            raw = await asyncio.wait_for(resp.content.read(), 10.0)
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[0] == b": waking model m1"
    return r, events


@pytest.mark.slow
async def test_a_held_stream_refused_after_it_started_ends_with_an_sse_error_event(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    path, body = "/v1/chat/completions", {**CHAT, "stream": True}
    r, events = await _refused_cold_stream(nats_server, prefix, nc, routers, path, body)
    assert events[-1].startswith(b'data: {"error": ') and b"no node has 80 GB free" in events[-1]
    assert r.ctx.metrics.requests_count("m1", 503) == 1


@pytest.mark.slow
async def test_a_held_anthropic_stream_refused_after_it_started_ends_with_anthropics_error_event(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    body = {"model": "m1", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    _, events = await _refused_cold_stream(nats_server, prefix, nc, routers, "/v1/messages", body)
    name, _, data = events[-1].partition(b"\n")
    assert name == b"event: error" and b"[DONE]" not in events[-1], events
    err = json.loads(data.removeprefix(b"data: "))
    assert err["type"] == "error" and err["error"]["type"] == "overloaded_error"
    assert "no node has 80 GB free" in err["error"]["message"]


async def test_held_requests_take_places_in_the_admission_queue() -> None:
    """Requests held for a model and requests queued at its concurrency limit share one bound."""
    gate = Gate("m1", limit=1, max_queue=2, queue_timeout_s=5.0)
    assert gate.try_enter()
    gate.held = 2
    with pytest.raises(AdmissionRefused, match="queue of 2 is full"):
        await gate.enter()
    gate.held = 1
    waiting = asyncio.create_task(gate.enter())
    await eventually(lambda: gate.queued == 1, timeout=5.0, what="one request to queue at the gate")
    gate.leave()
    await asyncio.wait_for(waiting, 5.0)
