"""The control-plane process: the composition root of ingest, leadership, the reconcile loop and the
desired state.

Bus reports come in through :mod:`ingest` into the tables (:mod:`state`); :mod:`reconcile_loop` turns
every ``tick_s``, or sooner when a message changed something that matters: judge node health by our own
clock -> :class:`Snapshot` -> :func:`reconcile` (pure) -> ``apply_plan`` (the one function that writes)
-> routing endpoints -> events. Only the lease holder passes and writes (:mod:`leadership`); a standby
keeps its tables warm from the same subscriptions and takes over when the lease lapses. The ctl verbs
(:mod:`api`) read through :class:`CtlReads` and change the desired state through :class:`DesiredState`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from llmgw_common.catalog import CatalogError
from llmgw_common.codec import encode
from llmgw_common.ctl import DebugStatsReply
from llmgw_common.errors import InvalidInput
from llmgw_common.router_messages import DemandWholeAsk, WakeReply, WakeRequest, WakeState
from llmgw_common.subjects import Subjects
from llmgw_controlplane.admin import AdminBindError, AdminServer, CtlApiSource, build_admin_app
from llmgw_controlplane.admin.usage_history import add_usage_history_route, ledger_readers
from llmgw_controlplane.api import CtlApi
from llmgw_controlplane.apply import AssignmentWriter, ReplicaStore
from llmgw_controlplane.console.usage import UsageBook
from llmgw_controlplane.desired import DesiredState, DesiredStore
from llmgw_controlplane.events import EventPublisher
from llmgw_controlplane.failures import FailureBook
from llmgw_controlplane.ingest import Ingest
from llmgw_controlplane.leader import Lease
from llmgw_controlplane.leadership import Leadership
from llmgw_controlplane.metrics import ControlPlaneMetrics, add_metrics_route
from llmgw_controlplane.pass_requests import PassReason, PassRequests
from llmgw_controlplane.pass_verdicts import Verdicts
from llmgw_controlplane.reconcile_loop import MAX_FAILED_PASSES, ReconcileLoop
from llmgw_controlplane.routing_publisher import RoutingPublisher
from llmgw_controlplane.scheduler.adapter_book import AdapterBook
from llmgw_controlplane.scheduler.adapter_reports import AdapterReports
from llmgw_controlplane.scheduler.adapters import AdapterPolicy
from llmgw_controlplane.scheduler.autoscale import Autoscaler, idle_lookup
from llmgw_controlplane.scheduler.demand import DemandBook
from llmgw_controlplane.scheduler.event_detection import EventDetector
from llmgw_controlplane.scheduler.idle import IdleMerger
from llmgw_controlplane.scheduler.phase import serving
from llmgw_controlplane.scheduler.snapshot import Snapshot
from llmgw_controlplane.settings import ControlPlaneSettings
from llmgw_controlplane.settling import Settling
from llmgw_controlplane.state import ClusterState
from llmgw_controlplane.tables import Tables
from llmgw_controlplane.wakes import WakeResponder
from llmgw_runtime import bus
from llmgw_runtime.clockcheck import Doubts
from llmgw_runtime.runtime import PassGuard, cancel_and_wait, until_stopped
from llmgw_runtime.tracing import start_tracing

__all__ = ["MAX_FAILED_PASSES", "ControlPlane", "StartupError", "serve"]

log = logging.getLogger("llmgw.controlplane")

# Routers report every tick (1 s): one silent for this many of our ticks is forgotten.
IDLE_STALE_TICKS = 5


class StartupError(InvalidInput, RuntimeError):
    """The control plane cannot start (e.g. its catalog is invalid); the message says every reason."""


class ControlPlane:
    """Builds the parts and runs their two loops (lease, reconcile); what each does is in its module."""

    def __init__(
        self,
        s: ControlPlaneSettings,
        nc: NATS,
        *,
        clock: Callable[[], float] = time.time,
        holder: str | None = None,
    ) -> None:
        self.s = s
        self.nc = nc
        self.js = nc.jetstream()
        self.clock = clock
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}"
        self.subjects = Subjects(s.prefix)
        self.drops = bus.DropLog(log)
        # Messages that decoded but whose claims are not believed (times, boots, seqs): one log line each.
        self.doubts = Doubts(log)
        self.state = ClusterState(
            heartbeat_interval_s=s.heartbeat_interval_s,
            unreachable_after_missed=s.unreachable_after_missed,
            node_lost_s=s.node_lost_s,
            doubts=self.doubts,
        )
        self.idle = IdleMerger(stale_s=max(IDLE_STALE_TICKS * s.tick_s, 5.0), doubts=self.doubts)
        self.detector = EventDetector(s.placement_failing_after_s)
        # Scale to zero, wakes and evictions (issue 13); wakes are answered only while leading.
        # Load following (issue 21): routers' demand reports, forgotten like their idle reports.
        self.demand = DemandBook(stale_s=max(IDLE_STALE_TICKS * s.tick_s, 5.0), doubts=self.doubts)
        self.adapters = AdapterBook(
            AdapterReports(stale_s=max(IDLE_STALE_TICKS * s.tick_s, 10.0)),
            AdapterPolicy(idle_s=s.adapter_idle_s, min_residency_s=s.adapter_min_residency_s),
        )
        self.autoscale = Autoscaler(s.eviction_min_residency_s, self.demand, self.adapters)
        # Spans of the wakes traced requests ask for (docs/tracing.md); the SDK loaded only when configured.
        self.tracer = (
            start_tracing("llmgw-controlplane", self.holder, s.otlp_traces_endpoint, 1.0)
            if s.otlp_traces_endpoint
            else None
        )
        self.wakes = WakeResponder(
            self.subjects.all_wake(),
            self._answer_wake,
            self.drops,
            # An adapter's answer changes with the agents' reports of it too (issue 33).
            version=lambda: self.state.version + self.adapters.reports.changes,
            tracer=self.tracer,
        )
        # Routers' token counts, for the console's Usage page.
        self.usage = UsageBook(doubts=self.doubts)
        self.failures = FailureBook()
        self.pass_requests = PassRequests()
        self.settling = Settling(s.settle_s, started_at=0.0)
        self.settling.listening_from(clock())
        self.ingest = Ingest(
            nc,
            self.subjects,
            state=self.state,
            idle=self.idle,
            usage=self.usage,
            drops=self.drops,
            clock=clock,
            passes=self.pass_requests,
            heartbeat_interval_s=s.heartbeat_interval_s,
            demand=self.demand,
            adapters=self.adapters.reports,
        )
        self._hb_window: deque[tuple[float, int]] = deque(maxlen=64)
        # Read at scrape time from the parts built in start(); served by the admin listener.
        self.metrics = ControlPlaneMetrics(self)
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Bind the buckets, read the desired state, subscribe; leading comes later, from run()."""
        js, sub = self.js, self.subjects
        # The lease bucket's TTL is the lease's; bind-or-create before ensure_all binds the rest.
        leader_kv = await bus.ensure_kv(
            js, sub.bucket_leader, ttl=self.s.lease_ttl_s, replicas=self.s.kv_replicas
        )
        made = await bus.ensure_all(js, sub, replicas=self.s.kv_replicas)
        # Read from each stream's leader, never a replica still catching up (bus.LeaderReads): what a
        # takeover loads and the lease it reads must be what was acknowledged.
        leader_kv = bus.leader_reads(leader_kv)
        buckets = {name: bus.leader_reads(kv) for name, kv in made.items()}
        self.kv_desired = buckets[sub.bucket_desired]
        self.assignments = AssignmentWriter(buckets[sub.bucket_assign], self.drops)
        self.records = ReplicaStore(buckets[sub.bucket_replicas], self.drops)
        self.routing = RoutingPublisher(buckets[sub.bucket_routing], self.drops)
        self.events = EventPublisher(js, sub)
        self.desired = DesiredState(
            self.kv_desired,
            DesiredStore(self.kv_desired, self.drops),
            state=self.state,
            routing=self.routing,
            passes=self.pass_requests,
            drops=self.drops,
        )
        self.api = CtlApi(self, self.desired, sub, self.s)
        tables = Tables(
            state=self.state,
            settling=self.settling,
            records=self.records,
            assignments=self.assignments,
            routing=self.routing,
            clock=self.clock,
            passes=self.pass_requests,
        )
        self.leadership = Leadership(
            Lease(leader_kv, self.holder, self.s.lease_ttl_s),
            tables,
            nc=self.nc,
            api=self.api,
            wakes=self.wakes,
            desired=self.desired,
        )
        self.loop = ReconcileLoop(
            self.s,
            tables,
            leadership=self.leadership,
            ingest=self.ingest,
            idle=self.idle,
            detector=self.detector,
            autoscale=self.autoscale,
            failures=self.failures,
            events=self.events,
        )
        # A takeover forgets what an earlier tenure wrote and judged, in this order.
        self.leadership.on_new_tenure += [
            self.loop.new_tenure,
            self.detector.new_tenure,
            self.autoscale.new_tenure,
        ]
        self.loop.on_pass = self.metrics.pass_seconds.observe
        try:
            await self.desired.load_catalog(self.s.catalog_file)
        except CatalogError as e:
            raise StartupError(f"catalog {self.s.catalog_file}: {e}") from None
        await self.desired.load_marks()
        self._subs = await self.ingest.subscribe()
        # Routers send only what changed in their demand; we hold no view yet, so ask for the whole.
        await self.nc.publish(
            self.subjects.demand_whole(), encode(DemandWholeAsk(asked_at=time.time(), by=self.holder))
        )
        await bus.flush(self.nc)
        self.settling.listening_from(self.clock())

    async def run(self, stop: asyncio.Event) -> None:
        self._tasks = [
            asyncio.create_task(self.leadership.run(stop), name="cp-lease"),
            asyncio.create_task(self.loop.run(stop), name="cp-reconcile"),
        ]
        try:
            # A loop that ends (a bug) ends the run: close() gives the lease up, the process exits non-zero.
            await until_stopped(stop, self._tasks)
        finally:
            await self.close()

    async def close(self) -> None:
        # A loop that died was reported by run(); its error must not stop the lease being given up.
        # Not one cancel: a loop's nats request can swallow it (see cancel_and_wait).
        await cancel_and_wait(self._tasks)
        self._tasks = []
        await self.api.stop()
        await self.wakes.stop()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)
        await self.leadership.release()
        for s in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await s.unsubscribe()
        self._subs = []

    def bus_lost(self) -> None:
        self.settling.bus_up = False

    def bus_back(self) -> None:
        """Reconnected: restart every node's silence clock and wait a settling window for reports."""
        now = self.clock()
        self.state.excuse_silence(now)
        self.settling.bus_back(now)
        log.info("bus back: waiting %.1fs for agents to report before reconciling", self.s.settle_s)
        self.pass_requests.request(PassReason.BUS_BACK)

    # ------------------------------------------------------------ what tests and the ctl verbs read

    @property
    def leader(self) -> bool:
        return self.leadership.leader

    @property
    def lease(self) -> Lease:
        return self.leadership.lease

    @property
    def fence(self) -> int:
        return self.leadership.fence

    @property
    def verdicts(self) -> Verdicts:
        return self.loop.verdicts

    @property
    def passes(self) -> int:
        return self.loop.passes

    @property
    def guard(self) -> PassGuard:
        return self.loop.guard

    def now(self) -> float:
        return self.clock()

    def snapshot(self) -> Snapshot:
        return self.state.snapshot(self.clock())

    def _answer_wake(self, req: WakeRequest) -> WakeReply:
        snap = self.snapshot()
        settling = snap.now < self.settling.until
        look = idle_lookup(self.idle, snap.now)
        reply = self.autoscale.answer(req, snap, look, self.loop.verdicts.backoff, settling)
        if reply.state is WakeState.WAKING:
            self.pass_requests.request(PassReason.WAKE)
        return reply

    def unplaceable_since(self, model: str) -> float | None:
        return self.detector.unplaceable_since(model)

    # The loops' steps, as tests drive them one at a time.

    async def _become_leader(self) -> None:
        await self.leadership.take_over()

    async def _step_down(self) -> None:
        await self.leadership.step_down()

    async def _tick(self, now: float) -> None:
        await self.loop.tick(now)

    # ------------------------------------------------------------ stats

    def debug_stats(self) -> DebugStatsReply:
        now = self.clock()
        self._hb_window.append((now, self.state.heartbeats))
        t_old, n_old = self._hb_window[0]
        rate = (self.state.heartbeats - n_old) / (now - t_old) if now > t_old else 0.0
        loop = self.loop
        ms = list(loop.pass_ms)
        snap = self.state.snapshot(now)
        desired = sum(p.replicas for p in snap.catalog.models)
        placed = sum(1 for r in snap.replicas if snap.catalog.get(r.model) is not None)
        try:
            import psutil

            rss: float | None = psutil.Process().memory_info().rss / 2**20
        except ImportError:
            rss = None
        return DebugStatsReply(
            leader=self.leader,
            fence=self.fence,
            started_at=self.settling.started_at,
            passes=loop.passes,
            failed_passes=loop.guard.failed,
            last_pass_ms=ms[-1] if ms else 0.0,
            pass_p50_ms=statistics.median(ms) if ms else 0.0,
            pass_p95_ms=sorted(ms)[int(len(ms) * 0.95)] if ms else 0.0,
            pass_max_ms=max(ms) if ms else 0.0,
            recent_pass_ms=tuple(round(x, 3) for x in ms[-50:]),
            last_reconcile_ms=loop.last_reconcile_ms,
            heartbeats=self.state.heartbeats,
            heartbeats_per_s=rate,
            dropped=self.drops.count + self.doubts.count,
            nodes=len(self.state.nodes),
            replicas=len(self.state.replicas),
            desired_replicas=desired,
            placed_replicas=placed,
            ready_replicas=sum(1 for r in snap.replicas if serving(snap, r)),
            unplaceable_models=len(loop.verdicts.unplaceable),
            assignment_writes=self.assignments.writes,
            rss_mb=rss,
        )


async def serve(s: ControlPlaneSettings, stop: asyncio.Event) -> None:
    """Run the control plane until ``stop`` is set. Raises :class:`StartupError` when it cannot start."""
    # The client exists before the ControlPlane that must hear of its reconnects.
    running: list[ControlPlane] = []

    def lost() -> None:
        for cp in running:
            cp.bus_lost()

    def back() -> None:
        for cp in running:
            cp.bus_back()

    nc = await bus.connect_unless_stopped(s, "controlplane", stop, on_disconnect=lost, on_reconnect=back)
    if nc is None:
        return
    try:
        cp = ControlPlane(s, nc)
        running.append(cp)
        await cp.start()
        admin: AdminServer | None = None
        if s.admin_port:
            # The console reads the same handlers as `llmgw ctl`, so the two cannot disagree.
            app = build_admin_app(CtlApiSource(cp.api, cp.usage), loopback_only=not s.allow_public_admin)
            add_metrics_route(app, cp.metrics)
            add_usage_history_route(app, *ledger_readers(nc, s.prefix))
            admin = AdminServer(app, s.admin_host, s.admin_port, s.allow_public_admin, log)
            try:
                await admin.start()
            except AdminBindError as e:
                await cp.close()
                raise StartupError(str(e)) from None
        log.info("control plane %s up on prefix %s", cp.holder, s.prefix)
        try:
            await cp.run(stop)
        finally:
            if admin is not None:
                await admin.close()
    finally:
        with contextlib.suppress(nats.errors.Error):
            await nc.drain()
