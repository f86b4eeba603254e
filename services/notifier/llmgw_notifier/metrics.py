"""The notifier's Prometheus metrics and the small listener that serves them at ``/metrics``.

Counters are read from :class:`NotifierStats` when Prometheus scrapes, so delivery counts nothing twice;
the delivery-lag histogram lives in the stats (observed when a receiver takes a message), and the age of
each target's oldest undelivered event is read from its worker's held events. Each watched model's probe
state (failures in a row, declared down by its probes, its budget) is read from the prober's own state;
its probe counts and times live in the stats (one update per probe). Targets are labelled by
their id (a hash of the URL), never the URL: a Slack webhook URL is a credential.

The listener is secondary to delivering alerts: a port already taken is logged and the notifier goes on
without it (a port another process holds must not stop alerts); Prometheus then sees the target down,
which is the alert.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from llmgw_notifier.delivery import TargetWorker
    from llmgw_notifier.probes import Prober
    from llmgw_notifier.settings import NotifierSettings
    from llmgw_notifier.stats import NotifierStats
    from llmgw_notifier.targets import Targets

__all__ = ["MetricsServer", "NotifierMetrics", "start_metrics"]

log = logging.getLogger("llmgw.notifier.metrics")

Workers = Callable[[], "Mapping[str, TargetWorker]"]


class _StatsCollector(Collector):
    def __init__(self, stats: NotifierStats, workers: Workers, prober: Prober | None) -> None:
        self.stats = stats
        self.workers = workers
        self.prober = prober

    def collect(self) -> Iterator[Metric]:
        st = self.stats
        yield GaugeMetricFamily(
            "llmgw_notifier_up", "1 once settings and catalog are read and workers started.", value=int(st.up)
        )
        outcomes = CounterMetricFamily(
            "llmgw_notifier_deliveries",
            "Events by what became of them: delivered (a receiver answered 2xx), gave_up (not taken within "
            "retry_for_s), filtered (the webhook does not take the kind), merged (already said by another "
            "source), undecodable, unrenderable.",
            labels=["outcome"],
        )
        for outcome, n in (
            ("delivered", st.delivered_events),
            ("gave_up", st.gave_up_events),
            ("filtered", st.filtered_events),
            ("merged", st.merged_events),
            ("undecodable", st.undecodable_events),
            ("unrenderable", st.unrenderable_events),
        ):
            outcomes.add_metric([outcome], n)
        yield outcomes
        yield CounterMetricFamily(
            "llmgw_notifier_delivered_messages",
            "Webhook messages taken by a receiver (a group of events is one message).",
            value=st.delivered_messages,
        )
        yield CounterMetricFamily(
            "llmgw_notifier_failed_attempts",
            "Webhook POSTs that failed; each is retried unless its message's retry_for_s has passed.",
            value=st.failed_attempts,
        )
        yield CounterMetricFamily(
            "llmgw_notifier_events_emitted",
            "model.down / model.recovered events the probes published.",
            value=st.events_emitted,
        )
        oldest = GaugeMetricFamily(
            "llmgw_notifier_oldest_undelivered_seconds",
            "Per target, how long its oldest event not yet taken by the receiver has been held (0: none).",
            labels=["target"],
        )
        for tid, worker in self.workers().items():
            held = [h.seen_at for h in worker.held.values()]
            oldest.add_metric([tid], max(0.0, worker.clock() - min(held)) if held else 0.0)
        yield oldest
        yield from st.delivery_lag.collect()
        yield from self._probes()

    def _probes(self) -> Iterator[Metric]:
        failing = GaugeMetricFamily(
            "llmgw_notifier_probe_failing",
            "Per watched model: 1 while its probes have declared it down (watch.failures probes in a row "
            "over their budget or failed, model.down sent), until one answers.",
            labels=["model"],
        )
        failures = GaugeMetricFamily(
            "llmgw_notifier_probe_failures",
            "Per watched model: probes failed in a row now (counted once the model was up).",
            labels=["model"],
        )
        budget = GaugeMetricFamily(
            "llmgw_notifier_probe_budget_seconds",
            "Per watched model: the time a probe may take (watch.budget).",
            labels=["model"],
        )
        if self.prober is not None:
            for model, spec in list(self.prober.specs.items()):
                state = self.prober.states.get(model)
                failing.add_metric([model], int(state is not None and state.down_since is not None))
                failures.add_metric([model], state.failures if state is not None else 0)
                budget.add_metric([model], spec.budget)
        yield failing
        yield failures
        yield budget
        outcomes = CounterMetricFamily(
            "llmgw_notifier_probes",
            "Probes per watched model by outcome: ok, over_budget (no answer within watch.budget), failed "
            "(an error answer, the router unreachable), refused (the probe key refused: says nothing of "
            "the model).",
            labels=["model", "outcome"],
        )
        for model, per in list(self.stats.probe_outcomes.items()):
            for outcome, n in per.items():
                outcomes.add_metric([model, outcome], n)
        yield outcomes
        yield from self.stats.probe_seconds.collect()


class NotifierMetrics:
    """A registry of this notifier's own (not the process-wide default: tests run several in one)."""

    def __init__(self, stats: NotifierStats, workers: Workers, prober: Prober | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatsCollector(stats, workers, prober))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """``GET /metrics`` on ``host:port``; :meth:`start` returns whether it listens."""

    def __init__(self, metrics: NotifierMetrics, host: str, port: int) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.bound_port: int | None = None
        app = web.Application()
        app.router.add_get("/metrics", self._scrape)
        self._runner = web.AppRunner(app, access_log=None)

    async def _scrape(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> bool:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
                raise
            log.warning(
                "metrics listener not started: cannot listen on %s:%d (%s); delivering without it "
                "(set metrics_port to a free port, or 0 for none)",
                self.host,
                self.port,
                e.strerror,
            )
            await self._runner.cleanup()
            return False
        self.bound_port = int(self._runner.addresses[0][1])
        log.info("metrics on http://%s:%d/metrics", self.host, self.bound_port)
        return True

    async def close(self) -> None:
        await self._runner.cleanup()


async def start_metrics(
    s: NotifierSettings, stats: NotifierStats, targets: Targets, prober: Prober | None = None
) -> MetricsServer | None:
    """The listener of ``s.metrics_host:metrics_port`` serving ``stats``, ``targets``' workers and
    ``prober``'s models, started; None when ``metrics_port`` is 0 or the port could not be had."""
    if not s.metrics_port:
        return None
    metrics = NotifierMetrics(stats, lambda: {tid: w for tid, (w, _) in targets.workers.items()}, prober)
    server = MetricsServer(metrics, s.metrics_host, s.metrics_port)
    return server if await server.start() else None
