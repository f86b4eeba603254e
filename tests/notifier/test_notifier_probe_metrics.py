"""The probes' Prometheus metrics: per watched model, whether its probes declared it down, failures in a
row, its budget, probes by outcome and their times. Once with the prober's state set by hand (exact), once
scraped over HTTP from a notifier probing a (fake, real-HTTP) router on a real nats-server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.catalog import WatchSpec
from llmgw_common.subjects import Subjects
from llmgw_notifier.metrics import NotifierMetrics
from llmgw_notifier.probe_request import ProbeResult
from llmgw_notifier.probes import Prober
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.stats import NotifierStats
from llmgw_runtime.bus import DropLog
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import free_port
from tests.http_clients import async_client
from tests.kit.poll import eventually
from tests.kit.promtext import family_names, value
from tests.notifier.notifier_helpers import Bus, running
from tests.notifier.test_notifier_metrics import listening, scrape
from tests.notifier.test_notifier_probes import FakeRouter, probe_settings

FAILING = "llmgw_notifier_probe_failing"
FAILURES = "llmgw_notifier_probe_failures"
BUDGET = "llmgw_notifier_probe_budget_seconds"
PROBES = "llmgw_notifier_probes_total"
SECONDS = "llmgw_notifier_probe_seconds"


@pytest.fixture
async def fake_router() -> AsyncIterator[FakeRouter]:
    r = await FakeRouter().start()
    yield r
    await r.stop()


async def test_probe_results_as_the_metrics_read_them(nc: NATS, prefix: str) -> None:
    stats = NotifierStats()
    wall = [1000.0]
    async with async_client() as http:
        prober = Prober(
            js=nc.jetstream(),
            subjects=Subjects(prefix),
            settings=NotifierSettings(prefix=prefix),
            http=http,
            stats=stats,
            drops=DropLog(logging.getLogger("test")),
            wall=lambda: wall[0],
        )
        metrics = NotifierMetrics(stats, lambda: {}, prober)
        spec = WatchSpec(probe_every=5.0, budget=2.0, failures=2)
        # As apply() sets them, with a stand-in for its loop: the results come from here.
        prober.specs["m"] = spec
        prober.tasks["m"] = asyncio.create_task(asyncio.sleep(3600))

        def text() -> str:
            return metrics.exposition().decode()

        assert (value(text(), FAILING, model="m"), value(text(), FAILURES, model="m")) == (0, 0)
        assert value(text(), BUDGET, model="m") == 2.0
        await prober.record("m", spec, ProbeResult(True, True, None, 0.3))
        over = ProbeResult(False, True, "no answer within the 2s budget", 2.0, over_budget=True)
        await prober.record("m", spec, over)
        t = text()
        assert (value(t, FAILING, model="m"), value(t, FAILURES, model="m")) == (0, 1)
        await prober.record("m", spec, ProbeResult(False, True, "HTTP 503: no replica", 0.01))
        t = text()
        # Two in a row: down by its probes (model.down published), so failing.
        assert (value(t, FAILING, model="m"), value(t, FAILURES, model="m")) == (1, 2)
        await prober.record("m", spec, ProbeResult(False, False, "the router refused the probe key", 0.01))
        t = text()
        assert value(t, FAILING, model="m") == 1  # a refused probe says nothing of the model
        for outcome, n in (("ok", 1), ("over_budget", 1), ("failed", 1), ("refused", 1)):
            assert value(t, PROBES, model="m", outcome=outcome) == n, outcome
        # Refused probes have no time: three observed, one of them over 1 s and 2 s.
        assert value(t, SECONDS + "_count", model="m") == 3
        assert value(t, SECONDS + "_bucket", model="m", le="1.0") == 2
        assert value(t, SECONDS + "_bucket", model="m", le="2.0") == 3
        await prober.record("m", spec, ProbeResult(True, True, None, 0.2))
        t = text()
        assert (value(t, FAILING, model="m"), value(t, FAILURES, model="m")) == (0, 0)
        # No longer watched: every series of the model goes.
        prober.apply({})
        t = text()
        assert {FAILING, FAILURES, BUDGET, PROBES, SECONDS + "_count"} & family_names(t) == set()
        assert 'model="m"' not in t
        await prober.close()


@pytest.mark.slow
async def test_a_probe_over_budget_shows_in_the_scraped_metrics_and_clears(
    nats_server: NatsServer, prefix: str, bus: Bus, fake_router: FakeRouter
) -> None:
    router = fake_router
    port = free_port()
    await bus.set_watched({"judge": WatchSpec(probe_every=0.3, budget=0.25, failures=2)})
    s = probe_settings(nats_server, prefix, router).model_copy(update={"metrics_port": port})
    async with running(s):
        await listening(port)

        async def answered() -> str | None:
            t = await scrape(port)
            n = value(t, PROBES, model="judge", outcome="ok")
            return t if n is not None and n >= 1 else None

        t = await eventually(answered, what="a probe of judge answered, in the metrics")
        assert value(t, FAILING, model="judge") == 0 and value(t, BUDGET, model="judge") == 0.25
        router.mode = "hang"  # every probe now overruns its budget

        async def failing() -> str | None:
            t = await scrape(port)
            return t if value(t, FAILING, model="judge") == 1 else None

        t = await eventually(failing, what="judge failing by its probes, in the metrics")
        over = value(t, PROBES, model="judge", outcome="over_budget")
        assert over is not None and over >= 2
        failures = value(t, FAILURES, model="judge")
        assert failures is not None and failures >= 2
        router.mode = "ok"

        async def cleared() -> bool:
            t = await scrape(port)
            return value(t, FAILING, model="judge") == 0 and value(t, FAILURES, model="judge") == 0

        await eventually(cleared, what="judge answering again, in the metrics")
