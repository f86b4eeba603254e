"""The control-plane process: bus in, tables, reconcile loop, plan applied, routing and events out.

Pipeline of one pass (every ``tick_s``, or sooner when a message changed something that matters):
judge node health by our own clock -> :class:`Snapshot` -> :func:`reconcile` (pure) -> :meth:`apply_plan`
(the one function that writes) -> routing endpoints -> events. Only the lease holder passes and writes;
a standby keeps its tables warm from the same subscriptions and takes over when the lease lapses.
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
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from llmgw_common import bus
from llmgw_common.catalog import Catalog, CatalogError, load_catalog_file
from llmgw_common.clockcheck import Doubts
from llmgw_common.ctl import DebugStatsReply
from llmgw_common.messages import (
    Assignment,
    ClusterSettings,
    Event,
    Heartbeat,
    IdleReport,
    Inventory,
    Marks,
    ReplicaRecord,
    ShardStatus,
    UsageReport,
    WakeReply,
    WakeRequest,
    WakeState,
)
from llmgw_common.messages import ShardPlacement as RecordShard
from llmgw_common.runtime import PassGuard, until_stopped
from llmgw_common.settings import ControlPlaneSettings
from llmgw_common.subjects import DESIRED_CATALOG, DESIRED_MARKS, DESIRED_SETTINGS, Subjects
from llmgw_controlplane.admin import AdminBindError, AdminServer, CtlApiSource, build_admin_app
from llmgw_controlplane.api import CtlApi
from llmgw_controlplane.apply import (
    AssignmentWriter,
    Fenced,
    NodeShards,
    ReplicaStore,
    RoutingPublisher,
    pin_specs,
)
from llmgw_controlplane.apply import desired_assignments as compute_assignments
from llmgw_controlplane.autoscale import Autoscaler, idle_lookup
from llmgw_controlplane.console.usage import UsageBook
from llmgw_controlplane.desired import DesiredStore
from llmgw_controlplane.events import EventDetector, EventPublisher, watch_inputs
from llmgw_controlplane.failures import FailureBook, failed_replica
from llmgw_controlplane.idle import IdleMerger
from llmgw_controlplane.leader import Lease, LeaseLost
from llmgw_controlplane.plan import Plan, ReconcileMemo
from llmgw_controlplane.reconciler import reconcile
from llmgw_controlplane.routing import cold_reason, coming_content, routing_content, serving
from llmgw_controlplane.snapshot import Snapshot
from llmgw_controlplane.state import ClusterState
from llmgw_controlplane.wakes import WakeResponder

log = logging.getLogger("llmgw.controlplane")

# Routers report every tick (1 s): one silent for this many of our ticks is forgotten.
IDLE_STALE_TICKS = 5
WRITE_BATCH = 64
# Reconcile passes failing in a row (a bug, not the bus), for at least one lease TTL, before the loop
# gives up: the process exits, giving the lease up, so that a standby (or the restarted process, with
# fresh state) takes over.
MAX_FAILED_PASSES = 10


class StartupError(RuntimeError):
    """The control plane cannot start (e.g. its catalog is invalid); the message says every reason."""


class ControlPlane:
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
        self.api = CtlApi(self)
        # Scale to zero, wakes and evictions (issue 13); wakes are answered only while leading.
        self.autoscale = Autoscaler(s.eviction_min_residency_s)
        self.wakes = WakeResponder(
            self.subjects.all_wake(), self._answer_wake, self.drops, version=lambda: self.state.version
        )
        # Routers' token counts, for the console's Usage page.
        self.usage = UsageBook(doubts=self.doubts)
        self._inventory_asked: dict[str, float] = {}
        self.memo = ReconcileMemo()
        self.failures = FailureBook()
        self._marks_revision = 0
        self.reasons: dict[str, str] = {}
        self.unplaceable: dict[str, str] = {}
        self.backoff: dict[str, str] = {}
        self.leader = False
        self.lease: Lease | None = None
        self.dirty = asyncio.Event()
        self.started_at = clock()
        self.settle_until = self.started_at + s.settle_s
        # False while this process is cut off from NATS: heartbeats cannot arrive, so no node's
        # silence may be judged (ARCHITECTURE: a lost command or reconnect must not leave nodes wrong).
        self.bus_up = True
        self.pass_ms: deque[float] = deque(maxlen=200)
        self.passes = 0
        self.guard = PassGuard("reconcile", log, limit=MAX_FAILED_PASSES, min_span_s=s.lease_ttl_s)
        self.last_reconcile_ms = 0.0
        self._hb_window: deque[tuple[float, int]] = deque(maxlen=64)
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._desired_cache: tuple[int, dict[str, NodeShards]] | None = None
        self._synced_generation = -1
        self._routing_key: tuple[int, dict[str, str], dict[str, str], tuple[str, ...]] | None = None

    # ------------------------------------------------------------ start

    async def start(self) -> None:
        js = self.js
        # The lease bucket's TTL is the lease's; bind-or-create before ensure_all binds the rest.
        leader_kv = await bus.ensure_kv(
            js, self.subjects.bucket_leader, ttl=self.s.lease_ttl_s, replicas=self.s.kv_replicas
        )
        buckets = await bus.ensure_all(js, self.subjects, replicas=self.s.kv_replicas)
        self.kv_desired = buckets[self.subjects.bucket_desired]
        self.desired = DesiredStore(self.kv_desired, self.drops)
        self.assignments = AssignmentWriter(buckets[self.subjects.bucket_assign], self.drops)
        self.records = ReplicaStore(buckets[self.subjects.bucket_replicas], self.drops)
        self.routing = RoutingPublisher(buckets[self.subjects.bucket_routing], self.drops)
        self.events = EventPublisher(js, self.subjects)
        self.lease = Lease(leader_kv, self.holder, self.s.lease_ttl_s)
        await self._load_catalog()
        await self._load_marks()
        sub = self.subjects
        self._subs = [
            await bus.subscribe(
                self.nc, sub.all_nodes("heartbeat"), Heartbeat, self._on_heartbeat, self.drops
            ),
            await bus.subscribe(
                self.nc, sub.all_nodes("inventory"), Inventory, self._on_inventory, self.drops
            ),
            await bus.subscribe(self.nc, sub.all_nodes("status"), ShardStatus, self._on_status, self.drops),
            await bus.subscribe(self.nc, sub.all_idle(), IdleReport, self._on_idle, self.drops),
            await bus.subscribe(self.nc, sub.all_usage(), UsageReport, self._on_usage, self.drops),
        ]
        await bus.sent(self.nc)
        self.started_at = self.clock()
        self.settle_until = self.started_at + self.s.settle_s

    async def _load_catalog(self) -> None:
        """The bus's catalog if there is one, else the file's (stored); an invalid file stops the start."""
        stored, _ = await bus.kv_get(self.kv_desired, DESIRED_CATALOG, Catalog, self.drops)
        if stored is not None:
            self.state.set_catalog(stored, 1)
            log.info("catalog from %s: %d model(s)", self.subjects.bucket_desired, len(stored.models))
            return
        if not self.s.catalog_file:
            log.warning("no catalog in %s and no catalog file: serving nothing", self.subjects.bucket_desired)
            return
        try:
            cat = load_catalog_file(self.s.catalog_file)
        except CatalogError as e:
            raise StartupError(f"catalog {self.s.catalog_file}: {e}") from None
        # If another control plane stored one meanwhile, that one is the desired state.
        cat = (
            await self.desired.change(DESIRED_CATALOG, Catalog, lambda cur: cat if cur is None else cur)
        ).new
        self.state.set_catalog(cat, 1)
        log.info("catalog from %s: %d model(s)", self.s.catalog_file, len(cat.models))

    async def _load_marks(self) -> None:
        marks, self._marks_revision = await bus.kv_get(self.kv_desired, DESIRED_MARKS, Marks, self.drops)
        self.state.marks = marks or Marks()

    # ------------------------------------------------------------ ingest (cheap: mark dirty only on news)

    def _from_its_subject(self, msg: Msg, sender: str, what: str = "node") -> bool:
        """Whether the node or router a message names is the one its subject names (``<prefix>.<kind>s
        .<sender>.<verb>``): permissions are per subject, so that one is the sender's."""
        parts = msg.subject.split(".")
        if len(parts) < 2 or parts[-2] != sender:
            self.drops.drop(msg.subject, f"claims {what} {sender!r}, not the subject's")
            return False
        return True

    async def _on_heartbeat(self, hb: Heartbeat, msg: Msg) -> None:
        if not self._from_its_subject(msg, hb.node):
            return
        now = self.clock()
        if self.state.on_heartbeat(hb, now):
            self.dirty.set()
        if self.state.wants_inventory(hb.node):
            # Its inventory went out before we listened (our restart, or a start race), or it claims a
            # new boot that only an inventory proves: ask, at most once per few heartbeats, instead of
            # holding the node back until its next periodic send.
            asked = self._inventory_asked.get(hb.node, float("-inf"))
            if now - asked >= 3 * self.s.heartbeat_interval_s:
                self._inventory_asked[hb.node] = now
                await self.nc.publish(self.subjects.inventory_request(hb.node))

    def _on_inventory(self, inv: Inventory, msg: Msg) -> None:
        if self._from_its_subject(msg, inv.node) and self.state.on_inventory(inv, self.clock()):
            self.dirty.set()

    def _on_status(self, st: ShardStatus, msg: Msg) -> None:
        if self._from_its_subject(msg, st.node) and self.state.on_status(st, self.clock()):
            self.dirty.set()

    def _on_usage(self, rep: UsageReport, msg: Msg) -> None:
        if self._from_its_subject(msg, rep.router, "router"):
            self.usage.add(rep, self.clock())

    def _on_idle(self, rep: IdleReport, msg: Msg) -> None:
        if self._from_its_subject(msg, rep.router, "router"):
            self.idle.add(rep, self.clock())

    # ------------------------------------------------------------ run

    async def run(self, stop: asyncio.Event) -> None:
        self._tasks = [
            asyncio.create_task(self._lease_loop(stop), name="cp-lease"),
            asyncio.create_task(self._reconcile_loop(stop), name="cp-reconcile"),
        ]
        try:
            # A loop that ends (a bug) ends the run: close() gives the lease up, the process exits non-zero.
            await until_stopped(stop, self._tasks)
        finally:
            await self.close()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        # A loop that died was reported by run(); its error must not stop the lease being given up.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.api.stop()
        await self.wakes.stop()
        if self.lease is not None and self.leader:
            await self.lease.release()
        self.leader = False
        for s in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await s.unsubscribe()
        self._subs = []

    async def _lease_loop(self, stop: asyncio.Event) -> None:
        assert self.lease is not None
        while not stop.is_set():
            held = await self.lease.step()
            if held and not self.leader:
                try:
                    await self.lease.while_renewing(self._become_leader())
                except (nats.errors.Error, TimeoutError, LeaseLost) as e:
                    log.warning("taking over failed (%s): retrying", e)
                    await self._step_down()
            elif not held and self.leader:
                await self._step_down()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.lease.renew_every_s)

    async def _become_leader(self) -> None:
        """Load what the previous leader (or this process before a restart) wrote, then act."""
        assert self.lease is not None
        now = self.clock()
        records = await self.records.load()
        current = await self.assignments.load()
        adopted = _adopt_from_assignments(records, current, now)
        if adopted:
            log.info("adopted %d replica(s) found only in assignments", len(adopted))
            records.update(adopted)
        for rec in records.values():
            for sp in rec.shards:
                self.state.know_node(sp.node, now)
        stored, _ = await bus.kv_get(self.kv_desired, DESIRED_CATALOG, Catalog, self.drops)
        if stored is not None and stored != self.state.catalog:
            self.state.set_catalog(stored, self.state.catalog_version + 1)
        self.state.set_replicas(pin_specs(records, self.state.catalog))
        self._desired_cache = None
        self._synced_generation = -1
        self._routing_key = None
        self.detector.new_tenure()
        self.autoscale.new_tenure()
        await self.routing.load()
        await self._load_marks()
        await self.routing.publish_catalog(self.state.catalog)
        self.state.catalog_version = max(self.state.catalog_version, self.routing.catalog_version)
        # Reports are awaited for a settling window from when this process began listening: a standby
        # that has listened that long already acts at once.
        self.settle_until = self.started_at + self.s.settle_s
        self.state.set_observed_from(self.started_at)
        self.leader = True
        await self.api.start(self.nc)
        await self.wakes.start(self.nc)
        log.info(
            "leading (fence %d): %d replica record(s), %d assignment(s); reconciling from %.1fs",
            self.lease.fence,
            len(records),
            len(current),
            max(0.0, self.settle_until - now),
        )
        self.dirty.set()

    def bus_lost(self) -> None:
        self.bus_up = False

    def bus_back(self) -> None:
        """Reconnected: restart every node's silence clock and wait a settling window for reports."""
        now = self.clock()
        self.state.excuse_silence(now)
        self.settle_until = max(self.settle_until, now + self.s.settle_s)
        self.bus_up = True
        log.info("bus back: waiting %.1fs for agents to report before reconciling", self.s.settle_s)
        self.dirty.set()

    async def _step_down(self) -> None:
        if self.leader:
            log.warning("no longer leading: stopped acting")
        self.leader = False
        await self.api.stop()
        await self.wakes.stop()

    async def _reconcile_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.dirty.wait(), self.s.tick_s)
            self.dirty.clear()
            if stop.is_set():
                return
            try:
                await self._tick(self.clock())
            except (nats.errors.Error, TimeoutError) as e:
                log.warning("reconcile pass could not write (%s): retrying next tick", e)
            except Exception as e:  # one bad input must not stop reconciling; the guard gives up at its limit
                self.guard.failure(e)
            else:
                self.guard.ok()

    async def _tick(self, now: float) -> None:
        """One turn of the loop: judge nodes; the leader also publishes events and, once settled, passes."""
        if not self.bus_up:
            return
        transitions = self.state.judge(now)
        node_events = self.detector.nodes(transitions, now)
        for name in self.state.forget_silent(now, self.s.node_forget_s):
            self.detector.forget_node(name)
            self._inventory_asked.pop(name, None)
            log.warning(
                "node %s forgotten: lost for over %gs with no replica on it", name, self.s.node_forget_s
            )
        self.idle.prune(now)
        self.state.prune_reports()
        if not self.leader:
            return
        assert self.lease is not None
        if not self.lease.held():
            await self._step_down()
            return
        await self.events.publish(node_events)
        if now < self.settle_until:
            return
        try:
            await self.pass_once(now)
        except Fenced as e:
            log.warning("write refused (%s): another control plane leads", e)
            await self._step_down()

    # ------------------------------------------------------------ one pass

    def snapshot(self) -> Snapshot:
        return self.state.snapshot(self.clock())

    def _answer_wake(self, req: WakeRequest) -> WakeReply:
        snap = self.snapshot()
        settling = snap.now < self.settle_until
        reply = self.autoscale.answer(req, snap, idle_lookup(self.idle, snap.now), self.backoff, settling)
        if reply.state is WakeState.WAKING:
            self.dirty.set()
        return reply

    async def pass_once(self, now: float) -> Plan:
        t0 = time.perf_counter()
        snap = self.state.snapshot(now)
        t1 = time.perf_counter()
        look = idle_lookup(self.idle, now)
        scale = self.autoscale.decide(snap, look)
        plan = reconcile(
            snap,
            self.memo,
            backoff_base_s=self.s.backoff_base_s,
            backoff_max_s=self.s.backoff_max_s,
            drain_grace_s=self.s.drain_grace_s,
            wanted=scale.wanted,
            stop_first=scale.stop_first,
        )
        stops = len(plan.stop)
        plan = self.autoscale.evict(plan, snap, look)
        if len(plan.stop) > stops:
            self.dirty.set()  # the room is freed: place the wanted replica on the next pass
        self.last_reconcile_ms = (time.perf_counter() - t1) * 1000
        self.memo = plan.memo
        if await self.apply_plan(plan, now):
            snap = self.state.snapshot(now)
        self.unplaceable = {m: u.summary for m, u in plan.unplaceable.items()}
        self.backoff = {
            m: f"crash loop: {b.failures} failure(s), last: {b.reason}; next attempt at "
            f"{time.strftime('%H:%M:%S', time.localtime(b.until))}"
            for m, b in plan.backoff.items()
        }
        why = {**self.unplaceable, **self.backoff}
        waking, cold = self.autoscale.waking(), self.autoscale.cold()
        key = (self.state.version, why, waking, cold)
        events: list[Event] = []
        if key != self._routing_key:
            # Only when the snapshot or the reasons changed: a steady pass skips this entirely.
            endpoints, unavailable = routing_content(snap, why)
            coming, cold_now = coming_content(snap, endpoints, waking, cold)
            for m in cold_now:
                p = snap.catalog.get(m)
                unavailable[m] = cold_reason(p.idle_after if p is not None else None)
            self.reasons = unavailable
            await self.routing.publish_endpoints(endpoints, unavailable, coming, cold_now)
            self._routing_key = key
        # Every pass, not only on change: a model becomes down by time alone (its watch budget).
        ready, budgets, silent = watch_inputs(snap)
        # A watched model allowed to scale to zero is not down while cold.
        budgets = {m: b for m, b in budgets.items() if m not in cold}
        events += self.detector.models(ready, budgets, {**self.reasons, **silent}, now)
        events += self.detector.placement(self.unplaceable, now)
        events += self.autoscale.events(snap)
        await self.events.publish(events)
        self.passes += 1
        self.pass_ms.append((time.perf_counter() - t0) * 1000)
        return plan

    async def apply_plan(self, plan: Plan, now: float) -> bool:
        """Records, then assignments (only those that changed), under the lease. True when tables changed."""
        st = self.state
        for nr in plan.place:
            st.put_replica(
                ReplicaRecord(
                    id=nr.replica_id,
                    model=nr.model,
                    created=now,
                    shards=tuple(
                        RecordShard(shard=s.shard, node=s.node, gpus=s.gpus, port=s.port) for s in nr.shards
                    ),
                    spec=nr.spec,
                )
            )
            log.info("place %s on %s", nr.replica_id, ", ".join(s.node for s in nr.shards))
        for sr in plan.stop:
            rec = st.replicas.get(sr.replica_id)
            if sr.failed and rec is not None:
                # Its errors and log tails go with its record: keep them for `ctl replicas` and `ctl models`.
                self.failures.add(failed_replica(st, rec, sr.reason, now))
            if st.drop_replica(sr.replica_id) is not None:
                log.info("stop %s: %s", sr.replica_id, sr.reason)
        for rid in plan.mark_draining:
            rec = st.replicas.get(rid)
            if rec is not None and not rec.draining:
                st.put_replica(rec.model_copy(update={"draining": True, "draining_since": now}))
        if st.generation == self._synced_generation:
            return plan.changes
        desired = self.desired_assignments()
        pending = self.assignments.pending(desired)
        assert self.lease is not None
        if not await self.lease.confirm():
            raise Fenced("the lease was lost before writing")
        await self.records.sync(st.replicas)
        items = list(pending.items())
        for i in range(0, len(items), WRITE_BATCH):
            batch = items[i : i + WRITE_BATCH]
            await asyncio.gather(*(self.assignments.write(n, sh, self.lease.fence, now) for n, sh in batch))
        self._synced_generation = st.generation
        return True

    def desired_assignments(self) -> dict[str, NodeShards]:
        gen = self.state.generation
        if self._desired_cache is None or self._desired_cache[0] != gen:
            addresses = {n: r.address for n, r in self.state.nodes.items()}
            self._desired_cache = (
                gen,
                compute_assignments(self.state.replicas, self.state.catalog, addresses),
            )
        return self._desired_cache[1]

    # ------------------------------------------------------------ desired state (ctl verbs)

    async def apply_catalog(self, catalog: Catalog) -> tuple[Catalog, int]:
        """Store ``catalog``; returns the one it replaced (as stored, not as this process last saw it)."""
        old = (await self.desired.change(DESIRED_CATALOG, Catalog, lambda _: catalog)).old
        self.state.set_catalog(catalog, self.state.catalog_version + 1)
        await self.routing.publish_catalog(catalog)
        log.info("catalog v%d applied: %d model(s)", self.state.catalog_version, len(catalog.models))
        self.dirty.set()
        return old or Catalog(), self.state.catalog_version

    async def change_marks(self, change: Callable[[Marks | None], Marks]) -> Marks:
        """Apply ``change`` (pure) to the stored marks, compare-and-set; returns the marks now stored."""
        ch = await self.desired.change(DESIRED_MARKS, Marks, change)
        if ch.revision >= self._marks_revision:
            # Verbs finish in any order: never step back to a value an overlapping verb has superseded.
            self._marks_revision = ch.revision
            self.state.marks = ch.new
        self.dirty.set()
        return ch.new

    async def read_settings(self) -> ClusterSettings:
        cur, _ = await bus.kv_get(self.kv_desired, DESIRED_SETTINGS, ClusterSettings, self.drops)
        return cur or ClusterSettings()

    async def store_settings(self, settings: ClusterSettings) -> None:
        await self.desired.change(DESIRED_SETTINGS, ClusterSettings, lambda _: settings)

    # ------------------------------------------------------------ stats

    def debug_stats(self) -> DebugStatsReply:
        now = self.clock()
        self._hb_window.append((now, self.state.heartbeats))
        t_old, n_old = self._hb_window[0]
        rate = (self.state.heartbeats - n_old) / (now - t_old) if now > t_old else 0.0
        ms = list(self.pass_ms)
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
            fence=self.lease.fence if self.lease else 0,
            started_at=self.started_at,
            passes=self.passes,
            failed_passes=self.guard.failed,
            last_pass_ms=ms[-1] if ms else 0.0,
            pass_p50_ms=statistics.median(ms) if ms else 0.0,
            pass_p95_ms=sorted(ms)[int(len(ms) * 0.95)] if ms else 0.0,
            pass_max_ms=max(ms) if ms else 0.0,
            recent_pass_ms=tuple(round(x, 3) for x in ms[-50:]),
            last_reconcile_ms=self.last_reconcile_ms,
            heartbeats=self.state.heartbeats,
            heartbeats_per_s=rate,
            dropped=self.drops.count + self.doubts.count,
            nodes=len(self.state.nodes),
            replicas=len(self.state.replicas),
            desired_replicas=desired,
            placed_replicas=placed,
            ready_replicas=sum(1 for r in snap.replicas if serving(snap, r)),
            unplaceable_models=len(self.unplaceable),
            assignment_writes=self.assignments.writes,
            rss_mb=rss,
        )


def _adopt_from_assignments(
    records: dict[str, ReplicaRecord], current: dict[str, Assignment], now: float
) -> dict[str, ReplicaRecord]:
    """Replicas that run by an assignment but have no record (records lost): rebuild their records."""
    shards: dict[str, list[RecordShard]] = {}
    models: dict[str, str] = {}
    for node, a in current.items():
        for sa in a.shards:
            if sa.replica_id in records:
                continue
            shards.setdefault(sa.replica_id, []).append(
                RecordShard(shard=sa.shard, node=node, gpus=sa.gpus, port=sa.port)
            )
            models[sa.replica_id] = sa.model
    return {
        rid: ReplicaRecord(
            id=rid, model=models[rid], created=now, shards=tuple(sorted(sh, key=lambda s: s.shard))
        )
        for rid, sh in shards.items()
    }


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

    nc = await bus.connect(s, "controlplane", on_disconnect=lost, on_reconnect=back)
    try:
        cp = ControlPlane(s, nc)
        running.append(cp)
        await cp.start()
        admin: AdminServer | None = None
        if s.admin_port:
            # The console reads the same handlers as `llmgw ctl`, so the two cannot disagree.
            app = build_admin_app(CtlApiSource(cp.api, cp.usage), loopback_only=not s.allow_public_admin)
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
