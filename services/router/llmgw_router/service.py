"""Wiring: listeners, the bus followers that fill the pool and the key table, the per-tick reports.

Pipeline: KV ``<prefix>_routing`` (catalog, endpoints) and ``<prefix>_keys`` -> in-memory pool and
key table; ``<prefix>.node.*.load`` -> endpoint load; HTTP -> auth -> admission -> scheduling ->
proxy. Each tick: one IdleReport, one UsageReport and one DemandReport. The HTTP side starts before
the bus is reached and keeps serving from what it holds when NATS is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time

import nats.errors
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.messages import LoadReport, RoutingCatalog
from llmgw_common.router_messages import DemandWholeAsk, ModelCache, UsageReport, WakeReply, WakeRequest
from llmgw_common.routing_table import RowFold
from llmgw_common.subjects import ROUTING_CATALOG, Subjects
from llmgw_common.tenancy import month_bounds
from llmgw_router.admin import build_admin_app
from llmgw_router.app import build_app
from llmgw_router.cache.metrics import CacheMetrics
from llmgw_router.cache.router import CacheLimits
from llmgw_router.cache.service import CacheService
from llmgw_router.context import Limits, RouterContext
from llmgw_router.demand import DemandMeter
from llmgw_router.demand_deltas import DemandDeltas
from llmgw_router.errors import error_body
from llmgw_router.failover.migration import abort_withdrawn
from llmgw_router.http.guard import ConnectionGuard, ConnectionMetrics, fit_to_fd_limit
from llmgw_router.http.server import HttpServer
from llmgw_router.routing.endpoints import Pool
from llmgw_router.settings import RouterSettings
from llmgw_router.static import load_static
from llmgw_router.tenancy.auth import Exemptions
from llmgw_router.tenancy.keymetrics import KeyUsageMetrics
from llmgw_router.tenancy.keys import KeyTable
from llmgw_router.tenancy.ledger import Ledger
from llmgw_router.tenancy.ledgermetrics import LedgerMetrics
from llmgw_router.tracing import RouterTracing
from llmgw_router.upstream.client import UpstreamClient
from llmgw_runtime import bus
from llmgw_runtime.kv_follower import KvFollower
from llmgw_runtime.runtime import PassGuard, cancel_and_wait, until_stopped
from llmgw_runtime.tracing import start_tracing
from llmgw_runtime.usage_ledger import read_hours

log = logging.getLogger("llmgw.router")
# How often the followers of the routing table and the keys ask their bucket's stream how far it is: one
# small answer, whatever the bucket holds; a change the watch lost is read within this (plus a moment),
# so a revoked key is refused within 1 s even then (issue 35).
FOLLOW_CHECK_S = 0.5
_ADMIN_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class Router:
    """One router: ``await start()``, then ``port``/``admin_port`` are bound; ``await run(stop)`` (which
    raises :class:`~llmgw_runtime.runtime.TaskDied` if a loop of the router ends); ``await stop()``."""

    def __init__(
        self, settings: RouterSettings, *, follow_bus: bool | None = None, reuse_port: bool = False
    ) -> None:
        self.settings = settings
        # SO_REUSEPORT on the OpenAI listener: `llmgw router --workers N` runs N routers on one port.
        self.reuse_port = reuse_port
        self.static = load_static(settings.static_file) if settings.static_file else None
        self.follow_bus = (self.static is None) if follow_bus is None else follow_bus
        pool = Pool()
        keys = KeyTable()
        auth = settings.auth
        if self.static is not None:
            pool.set_catalog(self.static.catalog, version=-1)
            pool.set_endpoints(self.static.routing.model_copy(update={"version": -1}))
            for r in self.static.keys:
                keys.put(r)
            auth = auth and self.static.auth
        self.ctx = RouterContext(
            router_id=settings.router_id,
            pool=pool,
            keys=keys,
            auth=auth,
            exemptions=Exemptions.parse(settings.auth_exempt),
            limits=Limits(
                max_body_bytes=settings.max_body_bytes,
                retries=settings.retries,
                max_migrations=settings.max_migrations,
                load_stale_s=settings.load_stale_s,
                connect_timeout_s=settings.connect_timeout_s,
                read_timeout_s=settings.read_timeout_s,
                stream_stall_s=settings.stream_stall_s,
                withdrawn_silence_s=settings.withdrawn_silence_s,
                # A router on a static table gets no next one to wait for.
                refused_wait_s=settings.refused_wait_s if self.follow_bus else 0.0,
                body_timeout_s=settings.body_timeout_s,
                prefix_affinity=settings.prefix_affinity,
                prefix_load_factor=settings.prefix_load_factor,
                tick_s=settings.tick_s,
            ),
            started=time.time(),
        )
        self.subjects = Subjects(settings.prefix)
        self.drops = bus.DropLog(log)
        self.nc: NATS | None = None
        self.port = 0
        self.admin_port = 0
        self._runners: list[web.AppRunner] = []
        self.http: HttpServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._followers: list[KvFollower] = []
        self.synced = asyncio.Event()
        # The routing table's rows (and the legacy whole value) as followed; applied to the pool once
        # per burst of rows (a start's replay brings thousands), not once per row.
        self.table = RowFold()
        self._table_due = False
        self.connections = ConnectionGuard(
            fit_to_fd_limit(settings.max_connections), settings.header_timeout_s, settings.write_timeout_s
        )
        self.ctx.metrics.registry.register(ConnectionMetrics(self.connections))
        self.ctx.metrics.registry.register(KeyUsageMetrics(self.ctx.usage, self.ctx.keys))
        self.ctx.metrics.registry.register(CacheMetrics(lambda: self.cache, self.ctx.pool.prefix_counters))
        self.ctx.metrics.registry.register(LedgerMetrics(lambda: self.ledger))
        # A failing tick is logged and counted, never the tick's end: the router goes on serving.
        self.tick_guard = PassGuard("router tick", log)
        self._closing = asyncio.Event()
        # On stop, requests in flight (streams included) get this long to finish.
        self.shutdown_grace_s = 10.0
        self.ctx.holding.ask = self._ask_wake
        if settings.otlp_traces_endpoint:
            # The SDK is imported here only (llmgw_runtime.tracing): a router with tracing off never loads it.
            # The router samples (RouterTracing.begin); the SDK records every span it is given.
            self.ctx.tracing = RouterTracing(
                start_tracing("llmgw-router", settings.router_id, settings.otlp_traces_endpoint, 1.0),
                settings.trace_sample_ratio,
            )
        self.demand = DemandMeter(self.ctx)
        # The demand report as it goes out: what changed, bounded messages (issue 35).
        self.demand_deltas = DemandDeltas()
        # The tick's reports failed to publish (a message over max_payload, NATS away): said at warning
        # once, then at debug until they go again.
        self.publish_failing = False
        # Usage kept durably (KV <prefix>_usage), once the bus is reached.
        self.ledger: Ledger | None = None
        # Routing by cached prefix (cache/), once the bus is reached.
        self.cache: CacheService | None = None
        self.demand.cache_report = self._cache_report

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        if s.admin_port and s.admin_host not in _ADMIN_LOOPBACK:
            raise ValueError(f"admin listener must be on loopback, not {s.admin_host}")
        lim = self.ctx.limits
        self.ctx.upstream = UpstreamClient(
            lim.connect_timeout_s, lim.read_timeout_s, stall_timeout_s=lim.stream_stall_s
        )
        # The router's own HTTP/1.1 server (http/), with the deadlines and cap of http/guard.py; the server's
        # own refusals (400, 431, ...) in OpenAI's shape.
        self.http = HttpServer(
            build_app(self.ctx),
            self.connections,
            s.max_body_bytes,
            s.idle_timeout_s,
            trusted_proxies=s.trusted_proxies,
            error_body=error_body,
        )
        self.port = await self.http.listen(s.host, s.port, backlog=4096, reuse_port=self.reuse_port)
        if s.admin_port:
            admin = web.AppRunner(build_admin_app(self.ctx), access_log=None)
            await admin.setup()
            await web.TCPSite(admin, s.admin_host, s.admin_port).start()
            self._runners.append(admin)
            self.admin_port = _bound_port(admin)
        log.info("router %s serving on %s:%d", s.router_id, s.host, self.port)
        if self.follow_bus:
            self._tasks.append(asyncio.create_task(self._bus_main(), name="router-bus"))
        else:
            self.synced.set()
        self._tasks.append(asyncio.create_task(self._tick(), name="router-tick"))

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set; a loop that ends (a bug) raises TaskDied, the caller then stops."""
        await until_stopped(stop, self._tasks)

    async def stop(self) -> None:
        # The grace first, with the bus and the ledger's writer still up, then the last flush (every
        # answer's usage written: ledger.py), then the drain.
        if self.http is not None:
            await self.http.shutdown(self.shutdown_grace_s)
            self.http = None
        self._closing.set()
        # A loop that died was reported by run(); stopping goes on regardless. Not one cancel: the
        # tick's flush can swallow it (see cancel_and_wait).
        await cancel_and_wait(self._tasks)
        self._tasks = []
        await self.ctx.holding.close()
        for f in self._followers:
            await f.stop()
        self._followers = []
        if self.cache is not None:
            await self.cache.stop()
            self.cache = None
        if self.nc is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                if self.ledger is not None and self.nc.is_connected:
                    await self.ledger.flush()
                await self._publish_reports()
                await self.nc.drain()
            self.nc = None
        for r in self._runners:
            await r.shutdown()
            await r.cleanup()
        self._runners = []
        if self.ctx.upstream is not None:
            await self.ctx.upstream.close()
            self.ctx.upstream = None
        if self.ctx.tracing is not None:
            # The last spans exported (the SDK's thread, bounded by its exporter's timeout).
            await asyncio.to_thread(self.ctx.tracing.shutdown)

    # ------------------------------------------------------------ bus

    async def _bus_main(self) -> None:
        s = self.settings
        nc = await bus.connect(s, f"router-{s.router_id}")
        self.nc = nc
        js = nc.jetstream()
        routing_kv = await bus.ensure_kv(js, self.subjects.bucket_routing, replicas=s.kv_replicas)
        keys_kv = await bus.ensure_kv(js, self.subjects.bucket_keys, replicas=s.kv_replicas)
        usage_kv = await bus.ensure_kv(js, self.subjects.bucket_usage, replicas=s.kv_replicas)
        await bus.subscribe(nc, self.subjects.all_nodes("load"), LoadReport, self._on_load, self.drops)
        # Peers' usage reports: their use of limited keys, from which each router's share is computed.
        await bus.subscribe(nc, self.subjects.all_usage(), UsageReport, self._on_usage, self.drops)
        await bus.subscribe(
            nc, self.subjects.demand_whole(), DemandWholeAsk, self._on_demand_whole_ask, self.drops
        )
        routing = KvFollower(routing_kv, self._on_routing, name="router-routing", resync_s=FOLLOW_CHECK_S)
        keyf = KvFollower(keys_kv, self._on_key, name="router-keys", resync_s=FOLLOW_CHECK_S)
        self._followers = [routing, keyf]
        await routing.start()
        self._apply_table()
        await keyf.start()
        # Routing by cached prefix: after the routing table's first read, so the nodes whose snapshots
        # make the index whole at start are known.
        cache = self._cache_service(nc)
        await cache.start()
        self.cache = cache
        self.ctx.cache = cache.routing
        self.ctx.choosing = dataclasses.replace(self.ctx.choosing, cache=cache.routing)
        self._routing_changed()
        # Day and month budgets spent before this start (by former routers, or ourselves before a
        # restart) stay spent: read from the ledger once, before the writer adds our own.
        now = self.ctx.clock()
        try:
            self.ctx.quota.load_spent(await read_hours(usage_kv, month_bounds(now)[0]), now)
        except (nats.errors.Error, TimeoutError) as e:
            log.warning("usage ledger not read (budgets count from this start only): %s", e)
        ledger = Ledger(
            self.ctx.usage,
            usage_kv,
            s.router_id,
            lambda: nc.is_connected,
            self.ctx.clock,
            interval_s=s.usage_write_interval_s,
        )
        self.ledger = ledger
        writer = asyncio.create_task(ledger.run(), name="router-ledger")
        self.synced.set()
        # From here this task stands for the followers: one of their loops ending is the router's death.
        try:
            await until_stopped(self._closing, [*routing.tasks, *keyf.tasks, writer])
        finally:
            await cancel_and_wait([writer])

    async def _tick(self) -> None:
        """Once per tick: close idle upstream connections, publish the idle and usage reports."""
        tick = self.settings.tick_s
        while True:
            # On the wall clock's multiples of the tick: every router recomputes its quota shares at
            # the same instant from the same reports (the last round's), so the shares add up.
            await asyncio.sleep(tick - self.ctx.clock() % tick)
            try:
                # Before the report: this tick's demand moved on and the shares recomputed from what
                # peers reported, with NATS away too (peers then fall silent and are forgotten).
                self.ctx.quota.tick(self.ctx.clock())
                if self.ctx.upstream is not None:
                    self.ctx.upstream.sweep()
                await self._publish_reports()
            except (nats.errors.Error, TimeoutError) as e:
                self.publish_failed(e)
            except Exception as e:  # a bug in one tick must not end the ticks (nor the serving)
                self.tick_guard.failure(e)
            else:
                self.tick_guard.ok()

    def publish_failed(self, e: BaseException) -> None:
        why = f"{type(e).__name__}: {e}".rstrip(": ")
        if self.publish_failing:
            log.debug("tick reports not published: %s", why)
            return
        self.publish_failing = True
        # At warning: a report that never goes (one over max_payload) leaves the control plane blind.
        log.warning("tick reports not published: %s (said once until they are again)", why)

    async def _publish_reports(self) -> None:
        if self.nc is None or not self.nc.is_connected:
            return
        now = time.time()
        rid = self.settings.router_id
        idle = self.ctx.idle.report(rid, now, self.ctx.pool.breakers_not_closed(), self.ctx.pool.busy())
        await self.nc.publish(self.subjects.idle(rid), encode(idle))
        await self.nc.publish(self.subjects.usage(rid), encode(self.ctx.usage.report(rid, now)))
        demand = self.demand_deltas.messages(self.demand.report(rid, now))
        for m in demand:
            await self.nc.publish(self.subjects.demand(rid), encode(m))
        await bus.flush(self.nc, timeout=2)
        self.demand_deltas.sent(demand)
        if self.publish_failing:
            self.publish_failing = False
            log.info("tick reports published again")

    def _cache_service(self, nc: NATS) -> CacheService:
        s, pool = self.settings, self.ctx.pool
        limits = CacheLimits(
            stale_s=s.load_stale_s, load_factor=s.prefix_load_factor, tokens_per_load=s.cache_tokens_per_load
        )
        return CacheService(
            nc,
            self.subjects,
            nodes=lambda: {e.node for eps in pool.by_model.values() for e in eps if e.node},
            models=lambda: list(pool.profiles),
            limits=limits,
            max_entries=s.cache_index_max_blocks,
            approx_ttl_s=s.cache_approx_ttl_s,
        )

    def _routing_changed(self) -> None:
        if self.cache is not None:
            pool = self.ctx.pool
            self.cache.routing_changed(pool.profiles.values(), pool.by_replica)

    def _cache_report(self, model: str) -> ModelCache | None:
        if self.cache is None:
            return None
        q, h = self.ctx.pool.prefix_counters(model)
        return self.cache.report(model, q, h)

    def _on_demand_whole_ask(self, ask: DemandWholeAsk, _: Msg) -> None:
        self.demand_deltas.ask_whole()

    def _on_usage(self, report: UsageReport, _: Msg) -> None:
        self.ctx.quota.on_report(report, self.ctx.clock())

    def _on_load(self, report: LoadReport, _: Msg) -> None:
        if self.ctx.pool.apply_load(report, self.ctx.clock()):
            # An adapter loaded (or its load failed): requests held for it go on (or are refused).
            self.ctx.holding.update()

    def _on_routing(self, key: str, value: bytes | None, revision: int) -> None:
        where = f"{self.subjects.bucket_routing}/{key}"
        try:
            if key != ROUTING_CATALOG:
                # The table's rows, its head, or the legacy whole value (llmgw_common.routing_table).
                if self.table.on_kv(key, value) and not self._table_due:
                    self._table_due = True
                    asyncio.get_running_loop().call_soon(self._apply_table)
                return
            if value is None:
                # A deleted key is not an empty catalog: keep serving from what we hold.
                log.warning("%s was deleted; keeping the last known value", where)
                return
            cat = decode(value, RoutingCatalog)
            self.ctx.pool.set_catalog(cat.catalog, cat.version)
            self.ctx.gates.configure(self.ctx.pool.profiles)
        except DecodeError as e:
            self.drops.drop(where, str(e))
            return
        self._routing_changed()
        # Held requests go on the update that brings their endpoint (or learn nothing is coming).
        self.ctx.holding.update()

    def _apply_table(self) -> None:
        """The rows changed since the last call, applied to the pool at once."""
        if not self._table_due:
            return
        self._table_due = False
        whole, models = self.table.take()
        if whole:
            withdrawn = self.ctx.pool.set_endpoints(self.table.table())
        else:
            # Only the models whose rows changed: a change costs its model, not the table.
            rows = self.table.rows
            withdrawn = self.ctx.pool.set_models({m: rows.get(m) for m in models}, self.table.version)
        abort_withdrawn(withdrawn, self.ctx.limits.withdrawn_silence_s)
        self._routing_changed()
        self.ctx.holding.update()

    async def _ask_wake(
        self, req: WakeRequest, timeout: float, headers: dict[str, str] | None = None
    ) -> WakeReply | None:
        """Ask the control plane to wake a cold model; None when no answer came. ``headers``: the trace
        context of the request that asked (NATS headers)."""
        nc = self.nc
        if nc is None or not nc.is_connected:
            return None
        subject = self.subjects.wake(self.settings.router_id)
        try:
            msg = await nc.request(subject, encode(req), timeout=timeout, headers=headers)
            return decode(msg.data, WakeReply)
        except (nats.errors.Error, TimeoutError) as e:  # no responder, no answer in time, NATS away
            log.debug("wake request for %s: %s", req.model, e or type(e).__name__)
        except DecodeError as e:
            self.drops.drop(subject, str(e))
        return None

    def _on_key(self, key: str, value: bytes | None, revision: int) -> None:
        try:
            self.ctx.keys.on_kv_change(key, value, revision)
        except DecodeError as e:
            self.drops.drop(f"{self.subjects.bucket_keys}/{key}", str(e))


def _bound_port(runner: web.AppRunner) -> int:
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            return int(addr[1])
    return 0


async def serve(
    settings: RouterSettings, stop: asyncio.Event, *, follow_bus: bool | None = None, reuse_port: bool = False
) -> None:
    """Run a router until ``stop`` is set."""
    router = Router(settings, follow_bus=follow_bus, reuse_port=reuse_port)
    await router.start()
    # Everything allocated so far lives as long as the process: keep it out of the collector's scans.
    gc.freeze()
    try:
        await router.run(stop)
    finally:
        await router.stop()
