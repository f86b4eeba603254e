"""The set of webhook targets, following the cluster settings: one delivery worker per target.

Targets are identified by their URL (a changed secret, filter or format keeps the target and its
place in the stream). A new target's consumer starts at the time the webhook first appeared in the
settings history we can still see (at most ``MAX_BACKFILL_S`` back), so a webhook added while the
notifier was down still hears what happened since. A removed target's consumer is deleted, and so is
any ``<prefix>-notifier-*`` consumer no current target owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable

import httpx
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from llmgw_common.codec import DecodeError, decode
from llmgw_common.messages import ClusterSettings, Webhook
from llmgw_common.subjects import DESIRED_SETTINGS, Subjects
from llmgw_common.urls import http_url_problem, shown_url
from llmgw_notifier.delivery import TargetWorker, consumer_name
from llmgw_notifier.formats import FORMATS
from llmgw_notifier.outages import OutageLedger
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.stats import NotifierStats
from llmgw_runtime.bus import DropLog
from llmgw_runtime.runtime import cancel_and_wait

log = logging.getLogger("llmgw.notifier.targets")

# A webhook never seen before gets at most this much of the past.
MAX_BACKFILL_S = 3600.0


def target_id(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def webhooks_by_target(cs: ClusterSettings) -> dict[str, Webhook]:
    """The targets of ``cs``, first entry winning when a URL is listed twice."""
    out: dict[str, Webhook] = {}
    for hook in cs.webhooks:
        if (problem := http_url_problem(hook.url)) is not None:
            # `llmgw setup` refuses these; one written straight into the bus is skipped, the rest kept.
            log.warning("webhook %s skipped: the URL %s", shown_url(hook.url), problem)
            continue
        tid = target_id(hook.url)
        if tid in out:
            log.warning(
                "webhook %s is listed twice in the settings; the first entry is used", shown_url(hook.url)
            )
            continue
        if hook.format not in FORMATS:
            log.warning(
                "webhook %s: unknown format %r, sending generic JSON", shown_url(hook.url), hook.format
            )
        out[tid] = hook
    return out


class Targets:
    """Runs a :class:`TargetWorker` per configured webhook; ``on_settings`` is a KvFollower callback."""

    def __init__(
        self,
        *,
        nc: NATS,
        js: JetStreamContext,
        kv_desired: KeyValue,
        subjects: Subjects,
        settings: NotifierSettings,
        http: httpx.AsyncClient,
        stats: NotifierStats,
        drops: DropLog,
        ledger: OutageLedger | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.nc = nc
        self.js = js
        self.kv = kv_desired
        self.subjects = subjects
        self.s = settings
        self.http = http
        self.stats = stats
        self.drops = drops
        self.ledger = ledger
        self.wall = wall
        self.workers: dict[str, tuple[TargetWorker, asyncio.Task[None]]] = {}
        self.desired: dict[str, Webhook] | None = None  # None until the settings were read once
        self._cleaned = False
        # The settings value could not be decoded: never read that as "no webhooks" (which would
        # delete every target's consumer and its place in the stream).
        self._undecodable = False
        self._lock = asyncio.Lock()

    async def on_settings(self, key: str, value: bytes | None, rev: int) -> None:
        if key != DESIRED_SETTINGS:
            return
        if value is None:
            desired: dict[str, Webhook] = {}
        else:
            try:
                desired = webhooks_by_target(decode(value, ClusterSettings))
            except DecodeError as e:
                # Keep delivering to the targets we know rather than dropping everyone.
                self.drops.drop(f"{self.subjects.bucket_desired}/{key}", str(e))
                self._undecodable = True
                return
        self._undecodable = False
        self.desired = desired
        await self.reconcile()

    async def mark_synced(self) -> None:
        """Called once the settings were read: no key means no webhooks (and stale consumers go)."""
        if self.desired is None and not self._undecodable:
            self.desired = {}
        await self.reconcile()

    def loops(self) -> list[asyncio.Task[None]]:
        """The current delivery workers, one per webhook (removed ones are not among them): one that
        ended is a death, which ends the notifier (``runtime.raise_if_died``), never restarted here."""
        return [task for _, task in self.workers.values()]

    async def reconcile(self) -> None:
        async with self._lock:
            desired = self.desired
            if desired is None:
                return
            if not desired and not self.workers and not self._cleaned:
                log.warning(
                    "no webhook is configured: nobody will be told of a lost node or a model that is down "
                    "(set one with `llmgw setup --webhook URL`)"
                )
            for tid, hook in desired.items():
                if tid in self.workers:
                    self.workers[tid][0].hook = hook
                    continue
                since = await self._since(hook.url)
                worker = TargetWorker(
                    target_id=tid,
                    hook=hook,
                    since=since,
                    nc=self.nc,
                    js=self.js,
                    subjects=self.subjects,
                    settings=self.s,
                    http=self.http,
                    stats=self.stats,
                    drops=self.drops,
                    ledger=self.ledger,
                )
                task = asyncio.create_task(worker.run(), name=f"notifier-target-{tid}")
                task.add_done_callback(_report)
                self.workers[tid] = (worker, task)
                log.info(
                    "delivering events to %s (%s) via consumer %s",
                    shown_url(hook.url),
                    hook.format,
                    worker.name,
                )
            for tid in [t for t in self.workers if t not in desired]:
                worker, task = self.workers.pop(tid)
                await _cancel(task)
                await self._delete_consumer(worker.name)
                log.info(
                    "webhook %s removed from the settings: no longer delivering to it",
                    shown_url(worker.hook.url),
                )
            if not self._cleaned:
                self._cleaned = True
                await self._delete_orphans(set(desired))

    async def close(self) -> None:
        async with self._lock:
            for _, task in self.workers.values():
                await _cancel(task)
            self.workers.clear()

    async def _since(self, url: str) -> float:
        """When ``url`` first appeared in the settings history still kept (bounded backfill)."""
        floor = self.wall() - MAX_BACKFILL_S
        try:
            entries = await self.kv.history(DESIRED_SETTINGS)
        except (nats.errors.Error, TimeoutError):
            return self.wall()
        first_rev: int | None = None
        for e in reversed(entries):  # newest first
            if e.value is None or e.operation in ("DEL", "PURGE"):
                break
            try:
                cs = decode(e.value, ClusterSettings)
            except DecodeError:
                break
            if not any(h.url == url for h in cs.webhooks):
                break
            first_rev = e.revision
        if first_rev is None:
            return self.wall()
        try:
            raw = await self.js.get_msg(f"KV_{self.subjects.bucket_desired}", seq=first_rev)
        except (nats.errors.Error, TimeoutError):
            return self.wall()
        if raw.time is None:
            return self.wall()
        return max(floor, raw.time.timestamp())

    async def _delete_consumer(self, name: str) -> None:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self.js.delete_consumer(self.subjects.events_stream, name)

    async def _delete_orphans(self, keep: set[str]) -> None:
        wanted = {consumer_name(self.subjects.prefix, t) for t in keep}
        stem = consumer_name(self.subjects.prefix, "")
        try:
            infos = await self.js.consumers_info(self.subjects.events_stream)
        except (nats.errors.Error, TimeoutError) as e:
            log.debug("could not list consumers: %s", e)
            return
        for info in infos:
            name = info.name
            if name.startswith(stem) and name not in wanted:
                log.info("deleting consumer %s: its webhook is no longer configured", name)
                await self._delete_consumer(name)


def _report(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("delivery worker %s crashed", task.get_name(), exc_info=task.exception())


async def _cancel(task: asyncio.Task[None]) -> None:
    if task.done():
        return  # a crash was reported by _report already
    # Not one cancel: a worker's fetch or ack can swallow it (see cancel_and_wait).
    await cancel_and_wait([task])
