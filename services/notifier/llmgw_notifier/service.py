"""``llmgw notifier``: webhooks for the events stream, and probes of watched models.

Pipeline: settings (KV ``<prefix>_desired``/``settings``) → one delivery worker per webhook, each
with its own durable consumer on ``<PREFIX>_EVENTS`` → merge the two sources of a model's outage
(``outages.py``) → group storms → render (Slack or signed JSON) → POST with retries → ack. Beside
it: catalog (KV ``<prefix>_routing``/``catalog``) → one probe loop per watched model →
``model.down``/``model.recovered`` into the same stream (failures count once the model was up: it
answered, or had a ready endpoint in ``<prefix>_routing``/``endpoints``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import nats.errors

from llmgw_common.subjects import DESIRED_SETTINGS, ROUTING_CATALOG, Subjects
from llmgw_notifier.metrics import MetricsServer, start_metrics
from llmgw_notifier.outages import OutageLedger
from llmgw_notifier.probes import Prober
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.stats import NotifierStats
from llmgw_notifier.targets import Targets
from llmgw_runtime.bus import DropLog, connect_unless_stopped, ensure_all
from llmgw_runtime.kv_follower import KvFollower
from llmgw_runtime.runtime import PassGuard, raise_if_died, until_stopped

log = logging.getLogger("llmgw.notifier")

# How often the settings are re-applied and the per-webhook and per-model loops checked for a death.
HOUSEKEEPING_S = 5.0
# Housekeeping passes failing in a row before the notifier exits (non-zero) to be restarted afresh.
MAX_FAILED_PASSES = 10


async def serve(s: NotifierSettings, stop: asyncio.Event, stats: NotifierStats | None = None) -> None:
    """Run until ``stop`` is set. ``stats`` lets a caller (a test) read the counters."""
    stats = stats if stats is not None else NotifierStats()
    subjects = Subjects(s.prefix)
    drops = DropLog(log)
    nc = await connect_unless_stopped(s, "llmgw-notifier", stop)
    if nc is None:
        return
    http = httpx.AsyncClient(follow_redirects=False, limits=httpx.Limits(max_connections=32))
    probe_http = httpx.AsyncClient(follow_redirects=False, limits=httpx.Limits(max_connections=32))
    followers: list[KvFollower] = []
    targets: Targets | None = None
    prober: Prober | None = None
    metrics: MetricsServer | None = None
    try:
        js = nc.jetstream()
        buckets = await ensure_all(js, subjects, replicas=s.kv_replicas)
        # Which models are down, and by whose word, from the model.* events in the stream: the probes
        # resume from it and the delivery workers merge the two sources of one outage through it.
        ledger = OutageLedger(js, subjects)
        await ledger.start()
        targets = Targets(
            nc=nc,
            js=js,
            kv_desired=buckets[subjects.bucket_desired],
            subjects=subjects,
            settings=s,
            http=http,
            stats=stats,
            drops=drops,
            ledger=ledger,
        )
        prober = Prober(js=js, subjects=subjects, settings=s, http=probe_http, stats=stats, drops=drops)
        metrics = await start_metrics(s, stats, targets, prober)
        prober.restore(ledger)
        followers = [
            KvFollower(
                buckets[subjects.bucket_desired], targets.on_settings, key=DESIRED_SETTINGS, name="settings"
            ),
            KvFollower(
                # Every key: the table is one row per model (llmgw_common.routing_table).
                buckets[subjects.bucket_routing],
                prober.on_endpoints,
                name="endpoints",
            ),
            KvFollower(
                buckets[subjects.bucket_routing], prober.on_catalog, key=ROUTING_CATALOG, name="catalog"
            ),
        ]
        for f in followers:
            await f.start()
        await targets.mark_synced()
        stats.up = True
        log.info("notifier up: stream %s, probes through %s", subjects.events_stream, s.router_url)
        # The followers run for the notifier's life: one of their loops ending ends it (TaskDied).
        lifelines = [t for f in followers for t in f.tasks]
        guard = PassGuard("notifier housekeeping", log, limit=MAX_FAILED_PASSES)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until_stopped(stop, lifelines), HOUSEKEEPING_S)
            if stop.is_set():
                break
            # A probe loop or delivery worker that died ends the notifier too: the one policy (runtime).
            raise_if_died([*prober.loops(), *targets.loops()])
            try:
                await targets.reconcile()
            except Exception as e:  # one bad pass must not end housekeeping; the guard gives up at its limit
                guard.failure(e)
            else:
                guard.ok()
    finally:
        if metrics is not None:
            await metrics.close()
        for f in followers:
            await f.stop()
        if prober is not None:
            await prober.close()
        if targets is not None:
            await targets.close()
        await http.aclose()
        await probe_http.aclose()
        with contextlib.suppress(nats.errors.Error, TimeoutError):  # a lost server must not mask the cause
            await nc.drain()
        log.info(
            "notifier stopped: %d event(s) delivered in %d message(s), %d given up, %d event(s) emitted",
            stats.delivered_events,
            stats.delivered_messages,
            stats.gave_up_events,
            stats.events_emitted,
        )
