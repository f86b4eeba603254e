"""A router's demand report on the bus (issue 35): what changed, in bounded messages, and the control
plane's book holding what whole reports would have said."""

from __future__ import annotations

import asyncio
import logging
import random
from types import SimpleNamespace

import nats.errors
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.router_messages import DemandReport, ModelCache, ModelDemand
from llmgw_common.subjects import Subjects
from llmgw_controlplane.scheduler.demand import DemandBook
from llmgw_router.demand_deltas import MAX_MODELS_PER_MESSAGE, WHOLE_EVERY_S, DemandDeltas
from llmgw_router.service import Router
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.kit.poll import eventually
from tests.router.router_helpers import RouterFactory

T0 = 50_000.0
MAX_PAYLOAD = 1024 * 1024


def entry(i: int, in_flight: int = 0, jitter: float = 0.0) -> ModelDemand:
    """A model's entry as a router sends it for a model nobody calls now: every figure set."""
    return ModelDemand(
        in_flight=in_flight,
        replicas_reporting=4,
        running=1.0,
        waiting=0.0,
        kv_use=0.1 + (i % 7) / 100,
        ttft_p90_ms=250.0,
        ttft_samples=12,
        window_s=30.0,
        arrived=3,
        completed=3,
        rate_s=60.0 + jitter,
        cache=ModelCache(mode="exact", prompt_tokens=1000, index_blocks=40) if i % 3 == 0 else None,
    )


def report(models: dict[str, ModelDemand], at: float, since: float = T0) -> DemandReport:
    return DemandReport(router="r1", since=since, sent_at=at, models=models)


def steady(n: int) -> dict[str, ModelDemand]:
    return {f"m{i:05d}": entry(i) for i in range(n)}


def test_a_tick_sends_what_changed_its_bytes_independent_of_the_model_count() -> None:
    sizes: dict[int, int] = {}
    for n in (500, 5_000):
        models = steady(n)
        full = report(models, T0 + 1)
        if n == 5_000:
            # The report as one message, as before: over NATS's max_payload, never delivered.
            assert len(encode(full)) > MAX_PAYLOAD
        dd = DemandDeltas()
        first = dd.messages(full)
        assert first[0].whole and not any(m.whole for m in first[1:])
        assert sum(len(m.models) for m in first) == n
        assert all(len(m.models) <= MAX_MODELS_PER_MESSAGE for m in first)
        assert all(len(encode(m)) < MAX_PAYLOAD // 2 for m in first)
        assert len({m.sent_at for m in first}) == 1
        dd.sent(first)
        # Next tick: one model busier, every rate base off by the tick's jitter: one entry goes.
        models = {m: d.model_copy(update={"rate_s": d.rate_s + 0.02}) for m, d in models.items()}
        models["m00001"] = entry(1, in_flight=2)
        (tick,) = dd.messages(report(models, T0 + 2))
        assert not tick.whole and list(tick.models) == ["m00001"] and tick.gone == []
        sizes[n] = len(encode(tick))
        dd.sent([tick])
        # Nothing changed: one empty message (the router stays known), a few dozen bytes.
        (idle,) = dd.messages(report(models, T0 + 3))
        assert idle.models == {} and len(encode(idle)) < 100
    assert sizes[500] == sizes[5_000] < 600


def test_a_failed_tick_is_sent_again_and_a_restart_or_a_minute_sends_it_whole() -> None:
    dd = DemandDeltas()
    models = steady(3)
    dd.sent(dd.messages(report(models, T0 + 1)))
    models["m00000"] = entry(0, in_flight=5)
    lost = dd.messages(report(models, T0 + 2))
    assert list(lost[0].models) == ["m00000"]
    # Not published (dd.sent not called): the change goes again with the next tick's.
    models["m00002"] = entry(2, in_flight=1)
    again = dd.messages(report(models, T0 + 3))
    assert sorted(again[0].models) == ["m00000", "m00002"]
    dd.sent(again)
    assert dd.messages(report(models, T0 + 4))[0].models == {}
    # A minute after the last whole one: whole again, every entry.
    (whole,) = dd.messages(report(models, T0 + 1 + WHOLE_EVERY_S))
    assert whole.whole and len(whole.models) == 3
    # The router restarted (another since): whole at once.
    (restart,) = dd.messages(report(models, T0 + 5, since=T0 + 4.5))
    assert restart.whole


def test_the_control_plane_book_holds_what_whole_reports_say() -> None:
    rng = random.Random(35)
    dd = DemandDeltas(max_models=7)
    by_delta, by_whole = DemandBook(stale_s=30.0), DemandBook(stale_s=30.0)
    models = steady(20)
    lost_at = T0 + 10
    for t in range(1, 130):
        now = T0 + t
        for _ in range(rng.randrange(4)):
            i = rng.randrange(25)
            name = f"m{i:05d}"
            if rng.random() < 0.2:
                models.pop(name, None)  # no longer follows load: gone
            else:
                models[name] = entry(i, in_flight=rng.randrange(5), jitter=rng.random() / 10)
        rep = report(dict(models), now)
        msgs = dd.messages(rep)
        dd.sent(msgs)
        by_whole.add(rep, now)
        if now == lost_at:
            continue  # lost on the way: the book is wrong until the next whole report
        for m in msgs:
            by_delta.add(m, now)
        got, want = by_delta.merged(now), by_whole.merged(now)
        if now < lost_at or now >= T0 + 1 + WHOLE_EVERY_S:
            assert got.keys() == want.keys(), now
            # Equal but for rate bases within the tick's jitter (not sent as changes).
            for name, g in got.items():
                w = want[name]
                assert g.in_flight == w.in_flight and abs(g.rate_s - w.rate_s) < 0.5, (now, name)


def test_a_router_whose_whole_report_was_missed_counts_only_from_its_next() -> None:
    book = DemandBook(stale_s=30.0)
    book.add(report(steady(3), T0 + 1), T0 + 1)
    # It restarted (another since), its whole report lost: its changes are kept, but it reports nothing
    # until its next whole one (a model it did not name must not look unreported).
    delta = report({"m00007": entry(7)}, T0 + 3, since=T0 + 2).model_copy(update={"whole": False})
    book.add(delta, T0 + 3)
    assert book.merged(T0 + 3) == {} and book.cache(T0 + 3) == {}
    gone = report({}, T0 + 4, since=T0 + 2).model_copy(update={"whole": False, "gone": ["m00007"]})
    book.add(gone, T0 + 4)
    assert book.merged(T0 + 4) == {}
    book.add(report({"m00001": entry(1)}, T0 + 5, since=T0 + 2), T0 + 5)
    book.add(report({"m00002": entry(2)}, T0 + 6, since=T0 + 2).model_copy(update={"whole": False}), T0 + 6)
    assert sorted(book.merged(T0 + 6)) == ["m00001", "m00002"]


@pytest.mark.slow
async def test_a_report_over_max_payload_is_said_at_warning_once(
    nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    # The report before issue 35, at 5,000 models: the server's max_payload refuses it.
    with pytest.raises(nats.errors.MaxPayloadError) as refused:
        await nc.publish("demand.r1", encode(report(steady(5_000), T0)))
    router = SimpleNamespace(publish_failing=False)
    caplog.set_level(logging.DEBUG, logger="llmgw.router")
    for _ in range(3):
        Router.publish_failed(router, refused.value)  # type: ignore[arg-type]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "MaxPayloadError" in warned[0].getMessage()
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 2


@pytest.mark.slow
async def test_a_control_plane_that_starts_gets_every_routers_whole_report_at_its_next_tick(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    # A router sends only what changed; a control plane started after it holds nothing of it and would
    # count it as not reporting until its minute is up. The new one asks, and the next tick is whole.
    subj = Subjects(prefix)
    seen: list[DemandReport] = []
    drops = bus.DropLog(logging.getLogger("t"))
    await bus.subscribe(nc, subj.all_demand(), DemandReport, lambda m, _: seen.append(m), drops)
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, tick_s=0.1, auth=False, router_id="rW")
    await asyncio.wait_for(r.synced.wait(), 10)
    await eventually(lambda: sum(not m.whole for m in seen) >= 3, timeout=5.0, what="deltas after the whole")
    assert seen[0].whole and not any(m.whole for m in seen[1:])
    before = len(seen)
    cp = await start_cp(cp_settings(nats_server.url, prefix, tick_s=0.1))
    try:
        await eventually(
            lambda: any(m.whole for m in seen[before:]), timeout=3.0, what="a whole report after the ask"
        )
    finally:
        await cp.stop()
    # Asked once, whole once: the ticks after it go back to what changed.
    await eventually(lambda: len(seen) >= before + 8, timeout=5.0, what="more ticks")
    assert sum(m.whole for m in seen[before:]) == 1
