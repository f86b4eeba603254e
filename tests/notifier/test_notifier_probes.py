"""Probes of watched models through a (fake, real-HTTP) router: down once, recovered once, slow is fine."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from nats.aio.client import Client as NATS

from llmgw_common.catalog import AdapterProfile, Catalog, ModelProfile, WatchSpec
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, RoutingCatalog, RoutingEndpoints, Webhook
from llmgw_common.subjects import ROUTING_CATALOG, ROUTING_ENDPOINTS, Subjects
from llmgw_notifier.outages import DOWN, RECOVERED
from llmgw_notifier.probe_request import ProbeResult, probe_once
from llmgw_notifier.probes import Prober
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.stats import NotifierStats
from llmgw_router.errors import error_body
from llmgw_runtime.bus import DropLog
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.runtime import cancel_and_wait
from tests.http_clients import async_client
from tests.kit.cancels import swallows_one_cancel
from tests.kit.poll import eventually
from tests.notifier.notifier_helpers import Bus, running

KEY = "sk-probe-test"


class FakeRouter:
    """``/v1/chat/completions`` answering per ``mode``: ok, fail (503), hang, slow, unauth (401),
    not_allowed (the real router's 404 for a model the key may not use, its own bytes)."""

    def __init__(self) -> None:
        self.mode = "ok"
        # model -> its own mode, over ``mode``
        self.modes: dict[str, str] = {}
        self.slow_s = 0.4
        self.requests: list[dict[str, Any]] = []
        self.answered: dict[str, int] = {}  # model -> probes answered 200
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, model: str) -> int:
        return sum(1 for r in self.requests if r["body"]["model"] == model)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"body": body, "auth": request.headers.get("Authorization")})
        mode = self.modes.get(body["model"], self.mode)
        if mode == "hang":
            await asyncio.sleep(30)
        if mode == "slow":
            await asyncio.sleep(self.slow_s)
        if mode == "fail":
            return web.json_response({"error": {"message": "no ready replica"}}, status=503)
        if mode == "unauth":
            return web.json_response({"error": {"message": "invalid key"}}, status=401)
        if mode == "not_allowed":
            # What llmgw_router.app answers when allows_model(key, model) is false.
            msg = f"The model '{body['model']}' does not exist or your API key may not use it"
            return web.Response(
                body=error_body(404, msg, param="model"), status=404, content_type="application/json"
            )
        model = body["model"]
        self.answered[model] = self.answered.get(model, 0) + 1
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "p"}}]})

    async def start(self) -> FakeRouter:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        assert isinstance(site._server, asyncio.Server)  # what loop.create_server made: it has sockets
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def router() -> AsyncIterator[FakeRouter]:
    r = await FakeRouter().start()
    yield r
    await r.stop()


def probe_settings(nats_server: NatsServer, prefix: str, router: FakeRouter) -> NotifierSettings:
    return NotifierSettings(
        nats_urls=[nats_server.url],
        prefix=prefix,
        router_url=router.url,
        probe_key=KEY,
        group_window_s=0.0,
        retry_base_s=0.05,
        retry_max_s=0.2,
        ack_wait_s=2.0,
    )


async def test_probe_once_classifies_answers(router: FakeRouter) -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    dead_port = free.getsockname()[1]
    free.close()
    async with async_client() as client:
        ok = await probe_once(client, router.url, KEY, "judge", 2.0)
        assert ok.ok and ok.conclusive
        assert router.requests[-1]["auth"] == f"Bearer {KEY}"
        assert router.requests[-1]["body"]["max_tokens"] == 1
        router.mode = "fail"
        r = await probe_once(client, router.url, KEY, "judge", 2.0)
        assert not r.ok and r.conclusive and r.error is not None and "503" in r.error
        router.mode = "hang"
        r = await probe_once(client, router.url, KEY, "judge", 0.3)
        assert (
            not r.ok and r.conclusive and r.error is not None and "0.3s budget" in r.error and r.elapsed < 2
        )
        router.mode = "unauth"
        r = await probe_once(client, router.url, KEY, "judge", 2.0)
        assert not r.ok and not r.conclusive and r.error is not None and "probe key" in r.error
        r = await probe_once(client, f"http://127.0.0.1:{dead_port}", KEY, "judge", 2.0)
        assert not r.ok and r.conclusive and r.error is not None and "unreachable" in r.error


@pytest.mark.slow
async def test_failing_probes_give_one_model_down_and_one_recovered_across_a_restart(
    nats_server: NatsServer, prefix: str, bus: Bus, router: FakeRouter, receivers: Any
) -> None:
    rx = await receivers()
    await bus.set_webhooks(Webhook(url=rx.url))
    await bus.set_watched({"judge": WatchSpec(probe_every=0.3, budget=0.25, failures=2), "other": None})
    s = probe_settings(nats_server, prefix, router)
    async with running(s):
        await eventually(lambda: router.answered.get("judge", 0) >= 2, what="two healthy probes of judge")
        assert await bus.events((DOWN, RECOVERED)) == []
        router.mode = "hang"  # every probe now overruns its budget
        await eventually(lambda: len(rx.requests) >= 1, what="the model.down to be delivered")
        n = router.count("judge")
        await eventually(lambda: router.count("judge") >= n + 3, what="more failing probes of judge")
    # A restart while still down must not announce it again.
    async with running(s):
        n = router.count("judge")
        await eventually(
            lambda: router.count("judge") >= n + 3, what="failing probes of judge after the restart"
        )
        assert [e.kind for e in await bus.events((DOWN, RECOVERED))] == [DOWN]
        router.mode = "ok"
        await eventually(lambda: len(rx.requests) >= 2, what="the model.recovered to be delivered")
        n = router.answered["judge"]
        await eventually(
            lambda: router.answered["judge"] >= n + 2, what="healthy probes of judge after the recovery"
        )
    events = await bus.events((DOWN, RECOVERED))
    assert [e.kind for e in events] == [DOWN, RECOVERED]
    down, rec = events
    assert down.subject == rec.subject == "judge"
    assert down.details["source"] == "probe" and "budget" in down.summary
    assert down.id.split(":")[-1] == rec.id.split(":")[-1]  # one episode
    assert [r.json["kind"] for r in rx.requests] == [DOWN, RECOVERED]
    assert router.count("other") == 0  # not watched, never probed
    assert all(r["auth"] == f"Bearer {KEY}" for r in router.requests)


@pytest.mark.slow
async def test_slow_within_budget_and_refused_key_produce_nothing(
    nats_server: NatsServer, prefix: str, bus: Bus, router: FakeRouter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.notifier.probes")
    router.mode = "slow"
    router.slow_s = 0.35
    # One failure would be enough to declare it down: any misjudged slow answer would show.
    spec = WatchSpec(probe_every=0.9, budget=0.9, failures=1)
    # "pace" is probed on the same period all along: its probes show how much of the notifier's time
    # has passed, where a sleep would only guess.
    await bus.set_watched({"judge": spec, "pace": spec})
    async with running(probe_settings(nats_server, prefix, router)):
        await eventually(
            lambda: router.answered.get("judge", 0) >= 3, what="three slow answers from the router"
        )
        router.mode = "unauth"
        n = router.count("judge")
        await eventually(lambda: router.count("judge") >= n + 2, what="probes refused for their key")
        assert await bus.events((DOWN, RECOVERED)) == []
        # A model leaves the watch list: its probes stop.
        await bus.set_watched({"judge": None, "pace": spec})
        await eventually(
            lambda: any("judge is no longer watched" in r.getMessage() for r in caplog.records),
            what="the notifier stopping judge's probes",
        )
        # A judge probe sent before the stop lands before a pace probe sent after it is answered.
        p = router.count("pace")
        await eventually(
            lambda: router.count("pace") >= p + 1, what="a probe of pace after judge's probes stopped"
        )
        n = router.count("judge")
        # Two more pace probes: judge's loop, on the same period, would have probed at least once.
        p = router.count("pace")
        await eventually(lambda: router.count("pace") >= p + 2, what="two more probes of pace")
        assert router.count("judge") == n
    assert await bus.events((DOWN, RECOVERED)) == []


# ---------------------------------------------------------------- probes refused for their key (issue 25)


async def test_probe_once_tells_a_key_refusal_from_a_down_model(router: FakeRouter) -> None:
    async with async_client() as client:
        router.mode = "unauth"
        r = await probe_once(client, router.url, None, "judge", 2.0)
        assert not r.conclusive and r.error is not None and "no probe key is set" in r.error
        assert router.requests[-1]["auth"] is None
        router.mode = "not_allowed"
        r = await probe_once(client, router.url, KEY, "judge", 2.0)
        assert not r.ok and not r.conclusive
        assert r.error is not None and "not allowed for judge" in r.error and "404" in r.error


@pytest.mark.slow
async def test_a_watched_model_the_probe_key_may_not_use_is_never_down(
    nats_server: NatsServer, prefix: str, bus: Bus, router: FakeRouter, caplog: pytest.LogCaptureFixture
) -> None:
    """The router answers 404 model_not_found for a model the key may not use (so that a key cannot map
    the catalog): a probe key restricted to other models made a healthy watched model down."""
    caplog.set_level(logging.INFO, logger="llmgw.notifier.probes")
    # One failure would be enough to declare it down, once it answered.
    spec = WatchSpec(probe_every=0.2, budget=1.0, failures=1)
    await bus.set_watched({"judge": spec})
    async with running(probe_settings(nats_server, prefix, router)):
        await eventually(lambda: router.answered.get("judge", 0) >= 1, what="a probe of judge answered")
        router.mode = "not_allowed"
        n = router.count("judge")
        await eventually(lambda: router.count("judge") >= n + 4, what="probes of judge refused for the key")
        assert await bus.events((DOWN, RECOVERED)) == []
        said = [r for r in caplog.records if "not allowed for judge" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.ERROR, "the operator is told once, at ERROR"
        router.mode = "ok"
        n = router.answered["judge"]
        await eventually(lambda: router.answered["judge"] >= n + 1, what="judge answering again")
    assert await bus.events((DOWN, RECOVERED)) == []


# ---------------------------------------------------------------- cold models (issue 13)
# A watched model scaled to zero (``watch: {allow_scale_to_zero: true}``) is not probed while cold: a
# probe would wake it, and keep it in use so that it never scales down again.


async def _routing(bus: Bus, version: int, cold: tuple[str, ...]) -> None:
    ep = RoutingEndpoints(version=version, cold=cold, unavailable={m: "scaled to zero" for m in cold})
    await bus.buckets[bus.subjects.bucket_routing].put(ROUTING_ENDPOINTS, encode(ep))


@pytest.mark.slow
async def test_a_cold_watched_model_is_not_probed_until_it_is_warm_again(
    nats_server: NatsServer, prefix: str, bus: Bus, router: FakeRouter, receivers: Any
) -> None:
    await _routing(bus, 1, ("judge",))
    spec = WatchSpec(probe_every=0.2, budget=0.15, failures=2, allow_scale_to_zero=True)
    await bus.set_watched({"judge": spec, "warm": spec})
    async with running(probe_settings(nats_server, prefix, router)):
        # The warm model is probed again and again meanwhile: the cold one never is.
        await eventually(lambda: router.count("warm") >= 4, what="four probes of the warm model")
        assert router.count("judge") == 0
        await _routing(bus, 2, ())
        await eventually(
            lambda: router.count("judge") >= 1, what="a probe of judge once it is no longer cold"
        )


@pytest.mark.slow
async def test_close_ends_a_probe_loop_that_swallowed_a_cancel(nc: NATS, prefix: str) -> None:
    """Python 3.11's asyncio.wait_for, in nats-py's request and so in a probe event's js.publish, drops
    a cancel that lands as its ack arrives (CPython gh-86296): a close() that cancelled each loop once
    then waited for it for ever, and the notifier never stopped."""
    from llmgw_common.subjects import Subjects
    from llmgw_notifier.probes import Prober
    from llmgw_notifier.stats import NotifierStats
    from llmgw_runtime.bus import DropLog

    async with async_client() as http:
        prober = Prober(
            js=nc.jetstream(),
            subjects=Subjects(prefix),
            settings=NotifierSettings(prefix=prefix),
            http=http,
            stats=NotifierStats(),
            drops=DropLog(logging.getLogger("test")),
        )

        stubborn = asyncio.create_task(swallows_one_cancel())
        prober.tasks["m"] = stubborn
        await asyncio.sleep(0)
        closing = asyncio.create_task(prober.close())
        try:
            # Not wait_for: it would cancel close(), whose own suppress would swallow that cancel too.
            done, _ = await asyncio.wait({closing}, timeout=5)
            assert closing in done and stubborn.done()
        finally:
            # Not one cancel each: the stand-in drops its first, and a failed check would then hang.
            await cancel_and_wait([closing, stubborn], again_s=0.05)


class PublishSwallowsOneCancel(Prober):
    """A Prober whose event publish swallows each loop's first cancel, as 3.11's asyncio.wait_for in
    js.publish does when the ack and the cancel arrive together (CPython gh-86296); ``then_hang`` makes
    the loop's record go on waiting afterwards (a next queued event's publish), else it returns."""

    def __init__(self, *, then_hang: bool, **kw: Any) -> None:
        super().__init__(**kw)
        self.then_hang = then_hang
        self.recording: set[asyncio.Task[Any]] = set()  # loops that reached a publish
        self.swallowed: set[asyncio.Task[Any]] = set()

    async def record(self, model: str, spec: WatchSpec, result: ProbeResult) -> None:
        me = asyncio.current_task()
        assert me is not None
        self.recording.add(me)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if me in self.swallowed:
                raise
            self.swallowed.add(me)
        if self.then_hang:
            await asyncio.sleep(3600)


def _swallowing_prober(
    prefix: str, nc: NATS, http: httpx.AsyncClient, router: FakeRouter, *, then_hang: bool
) -> PublishSwallowsOneCancel:
    return PublishSwallowsOneCancel(
        then_hang=then_hang,
        js=nc.jetstream(),
        subjects=Subjects(prefix),
        settings=NotifierSettings(prefix=prefix, router_url=router.url, probe_key=KEY),
        http=http,
        stats=NotifierStats(),
        drops=DropLog(logging.getLogger("test")),
    )


@pytest.mark.parametrize("change", ["replaced", "unwatched"])
async def test_a_retired_probe_loop_that_swallowed_its_cancel_ends(
    nc: NATS, prefix: str, router: FakeRouter, change: str
) -> None:
    """apply() cancels a loop whose spec changed or whose model is no longer watched once, without
    waiting (it is sync): a loop that swallowed that cancel went on probing and publishing events,
    untracked, next to its replacement."""
    async with async_client() as http:
        prober = _swallowing_prober(prefix, nc, http, router, then_hang=False)
        prober.apply({"m": WatchSpec(probe_every=0.05, budget=1.0)})
        old = prober.tasks["m"]
        try:
            await eventually(lambda: old in prober.recording, what="the loop to publish")
            prober.apply({"m": WatchSpec(probe_every=0.1, budget=1.0)} if change == "replaced" else {})
            done, _ = await asyncio.wait({old}, timeout=5)
            assert old in done, "the retired loop goes on"
            assert old in prober.swallowed
        finally:
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)
            await prober.close()


async def test_close_ends_a_retired_probe_loop_that_swallowed_its_cancel(
    nc: NATS, prefix: str, router: FakeRouter
) -> None:
    """A retired loop that swallowed apply()'s cancel and is still publishing is no longer in
    ``tasks``: close() returned while it went on, publishing on a closing connection."""
    async with async_client() as http:
        prober = _swallowing_prober(prefix, nc, http, router, then_hang=True)
        prober.apply({"m": WatchSpec(probe_every=0.05, budget=1.0)})
        old = prober.tasks["m"]
        await eventually(lambda: old in prober.recording, what="the loop to publish")
        prober.apply({})
        await eventually(lambda: old in prober.swallowed, what="the loop to swallow the cancel")
        closing = asyncio.create_task(prober.close())
        try:
            # Not wait_for: it would cancel close(), which could swallow that cancel too.
            done, _ = await asyncio.wait({closing}, timeout=5)
            assert closing in done
            assert old.done(), "close() returned while a retired loop goes on"
        finally:
            old.cancel()
            closing.cancel()
            await asyncio.gather(closing, old, return_exceptions=True)


# ---------------------------------------------------------------- watched LoRA adapters (issue 33)
# Probed by their own name through the router, as models are; their base's endpoints say whether they
# were up (a load is a request away) and whether they are cold (a probe would wake the base).


async def _adapters_catalog(bus: Bus, spec: WatchSpec, *models: ModelProfile) -> None:
    cat = Catalog(
        models=(ModelProfile(name="base", engine="sim", max_loras=2), *models),
        adapters=(
            AdapterProfile(name="fr", base="base", weights="/w/fr", watch=spec),
            AdapterProfile(name="de", base="base", weights="/w/de"),
        ),
    )
    rc = RoutingCatalog(version=int(time.time() * 1000), catalog=cat)
    await bus.buckets[bus.subjects.bucket_routing].put(ROUTING_CATALOG, encode(rc))


async def _base_ready(bus: Bus, version: int) -> None:
    eps = {"base": (Endpoint(replica_id="r0", model="base", url="http://127.0.0.1:9", node="n1"),)}
    ep = RoutingEndpoints(version=version, endpoints=eps)
    await bus.buckets[bus.subjects.bucket_routing].put(ROUTING_ENDPOINTS, encode(ep))


@pytest.mark.slow
async def test_a_watched_adapter_whose_load_fails_is_down_and_recovered_by_its_probes(
    nats_server: NatsServer, prefix: str, bus: Bus, router: FakeRouter, receivers: Any
) -> None:
    rx = await receivers()
    await bus.set_webhooks(Webhook(url=rx.url))
    await _base_ready(bus, 1)
    # Its load fails from the start (the router's 503 for it): never answered itself, but its base has
    # a ready endpoint, so it was up as far as a request can tell.
    router.modes["fr"] = "fail"
    await _adapters_catalog(bus, WatchSpec(probe_every=0.2, budget=0.5, failures=2))
    async with running(probe_settings(nats_server, prefix, router)):
        await eventually(lambda: len(rx.requests) >= 1, what="the adapter's model.down to be delivered")
        router.modes.pop("fr")
        await eventually(lambda: len(rx.requests) >= 2, what="the adapter's model.recovered")
        # Its base goes away (no endpoint left, not cold): the router's 503s for it make it down again.
        await bus.buckets[bus.subjects.bucket_routing].put(
            ROUTING_ENDPOINTS, encode(RoutingEndpoints(version=2, unavailable={"base": "replica failed"}))
        )
        router.modes["fr"] = "fail"
        await eventually(lambda: len(rx.requests) >= 3, what="model.down when its base is gone")
    events = await bus.events((DOWN, RECOVERED))
    assert [(e.kind, e.subject) for e in events] == [(DOWN, "fr"), (RECOVERED, "fr"), (DOWN, "fr")]
    assert events[0].summary.startswith("adapter fr (of model base) is not answering: 2 probe(s)")
    assert "HTTP 503" in events[0].summary and events[0].details["source"] == "probe"
    assert events[1].summary.startswith("adapter fr (of model base) answers again")
    # Only the watched adapter is probed: not its base, not the other adapter.
    assert router.count("fr") >= 3 and router.count("base") == router.count("de") == 0


@pytest.mark.slow
async def test_a_watched_adapter_is_not_probed_while_its_base_is_cold(
    nats_server: NatsServer, prefix: str, bus: Bus, router: FakeRouter
) -> None:
    await _routing(bus, 1, ("base",))
    spec = WatchSpec(probe_every=0.2, budget=0.15, failures=1, allow_scale_to_zero=True)
    # A watched model alongside, probed all the while, shows the notifier's time passing.
    await _adapters_catalog(bus, spec, ModelProfile(name="warm", engine="sim", watch=spec))
    async with running(probe_settings(nats_server, prefix, router)):
        await eventually(lambda: router.count("warm") >= 4, what="four probes of the warm model")
        assert router.count("fr") == 0
        await _base_ready(bus, 2)
        await eventually(lambda: router.count("fr") >= 1, what="a probe of fr once its base is warm")
    assert await bus.events((DOWN, RECOVERED)) == []
