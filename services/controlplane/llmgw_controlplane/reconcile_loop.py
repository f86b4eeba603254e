"""The reconcile loop: one turn every ``tick_s``, or sooner when ingest marked news.

A turn judges node health by our own clock (leader or not: a standby's tables stay warm). The leader,
once reports had time to arrive, announces node events from the cluster's announced state
(:mod:`announcements`: what no leader said in a takeover's gap is said now, once) and passes: snapshot
-> :func:`schedule` (pure: scale, follow the load, reconcile, hold drains, evict; one memo) ->
:meth:`ReconcileLoop.apply_plan` (the one writer of replica records and
assignments, under the lease) -> routing endpoints (only on change) -> model and placement events. A
pass that raises is counted by a :class:`PassGuard`; too many in a row end the loop, and so the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping

import nats.errors

from llmgw_common.messages import AdapterLoad, Event, ReplicaRecord
from llmgw_common.messages import ShardPlacement as RecordShard
from llmgw_controlplane.announcements import AnnouncedStore, FencedAbove, Judged
from llmgw_controlplane.apply import Fenced, NodeShards
from llmgw_controlplane.apply import desired_assignments as compute_assignments
from llmgw_controlplane.events import EventPublisher
from llmgw_controlplane.failures import FailureBook, failed_replica
from llmgw_controlplane.ingest import Ingest
from llmgw_controlplane.leadership import Leadership
from llmgw_controlplane.pass_requests import PassReason
from llmgw_controlplane.pass_verdicts import Verdicts
from llmgw_controlplane.scheduler.adapter_book import adapter_watch
from llmgw_controlplane.scheduler.autoscale import Autoscaler, idle_lookup
from llmgw_controlplane.scheduler.event_detection import EventDetector, watch_inputs
from llmgw_controlplane.scheduler.idle import IdleMerger
from llmgw_controlplane.scheduler.plan import Plan
from llmgw_controlplane.scheduler.routing import cold_reason, coming_content, routing_content
from llmgw_controlplane.scheduler.schedule import Policy, SchedulerMemo, schedule
from llmgw_controlplane.scheduler.snapshot import NodeState
from llmgw_controlplane.settings import ControlPlaneSettings
from llmgw_controlplane.tables import Tables
from llmgw_runtime.runtime import PassGuard

log = logging.getLogger("llmgw.controlplane")

WRITE_BATCH = 64
# Reconcile passes failing in a row (a bug, not the bus), for at least one lease TTL, before the loop
# gives up: the process exits, giving the lease up, so that a standby (or the restarted process, with
# fresh state) takes over.
MAX_FAILED_PASSES = 10
# Heartbeat periods this process listens before its takeover rewrites the stored routing table: one
# for every agent to have a turn, and half of one for the lateness of a loaded box.
TAKEOVER_LISTEN_HEARTBEATS = 1.5


class ReconcileLoop:
    """Turns of the loop, and the one writer of replica records and assignments."""

    def __init__(
        self,
        s: ControlPlaneSettings,
        tables: Tables,
        *,
        leadership: Leadership,
        ingest: Ingest,
        idle: IdleMerger,
        detector: EventDetector,
        autoscale: Autoscaler,
        failures: FailureBook,
        events: EventPublisher,
    ) -> None:
        self.s = s
        self.tables = tables
        self.leadership = leadership
        self.ingest = ingest
        self.idle = idle
        self.detector = detector
        self.autoscale = autoscale
        self.failures = failures
        self.events = events
        self.memo = SchedulerMemo()
        self.policy = Policy(
            backoff_base_s=s.backoff_base_s,
            backoff_max_s=s.backoff_max_s,
            drain_grace_s=s.drain_grace_s,
            min_residency_s=s.eviction_min_residency_s,
        )
        self.verdicts = Verdicts()
        self.guard = PassGuard("reconcile", log, limit=MAX_FAILED_PASSES, min_span_s=s.lease_ttl_s)
        self.passes = 0
        self.pass_ms: deque[float] = deque(maxlen=200)
        # Told each completed pass's seconds: the metrics' pass-time histogram (service.py sets it).
        self.on_pass: Callable[[float], None] = lambda seconds: None
        self.last_reconcile_ms = 0.0
        # What this tenure wrote, so that a steady pass writes nothing: reset by new_tenure().
        self._desired_cache: tuple[int, dict[str, tuple[AdapterLoad, ...]], dict[str, NodeShards]] | None = (
            None
        )
        self._synced_generation = -1
        self._adapters_synced: dict[str, tuple[AdapterLoad, ...]] = {}
        self._routing_key: tuple[object, ...] | None = None
        # Built here, from the publisher's JetStream context: node events and their record go together.
        self.announced = AnnouncedStore(events.js, events.subjects.prefix, replicas=s.kv_replicas)
        self._announce_failing = False
        # The publisher's dropped count when the record's unsent were last (re)read for publishing.
        self._dropped_seen = events.dropped

    def new_tenure(self) -> None:
        """Forget what was written while leading before: a new tenure writes from what it loaded."""
        self._desired_cache = None
        self._synced_generation = -1
        self._adapters_synced = {}
        self._routing_key = None
        self.memo = self.memo.new_tenure()
        self.announced.new_tenure()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.tables.passes.wait(self.s.tick_s)
            if stop.is_set():
                return
            try:
                await self.tick(self.tables.clock())
            except (nats.errors.Error, TimeoutError) as e:
                log.warning("reconcile pass could not write (%s): retrying next tick", e)
            except Exception as e:  # one bad input must not stop reconciling; the guard gives up at its limit
                self.guard.failure(e)
            else:
                self.guard.ok()

    async def tick(self, now: float) -> None:
        """One turn of the loop: judge nodes; the leader, once settled, also announces and passes."""
        if not self.tables.settling.bus_up:
            return
        # Transitions only mark work here: node events come from the announced state (announce_nodes),
        # so that one judged while no control plane led is not lost with this process's memory.
        self.tables.state.judge(now)
        for name in self.tables.state.forget_silent(now, self.s.node_forget_s):
            self.ingest.forget(name)
            log.warning(
                "node %s forgotten: lost for over %gs with no replica on it", name, self.s.node_forget_s
            )
        self.idle.prune(now)
        self.tables.state.prune_reports()
        lead = self.leadership
        if not lead.leader:
            return
        if not lead.lease.held():
            await lead.step_down()
            return
        if now < self.tables.settling.until:
            # Once a tenure, when agents had a heartbeat period to report since this process started.
            await lead.rewrite_taken_table(now, TAKEOVER_LISTEN_HEARTBEATS * self.s.heartbeat_interval_s)
            return
        # The pass writes the table itself (its own content supersedes the takeover's).
        lead.table_due = None
        try:
            await self.announce_nodes_or_say(now)
            await self.pass_once(now)
        except Fenced as e:
            log.warning("write refused (%s): another control plane leads", e)
            await lead.step_down()

    async def announce_nodes_or_say(self, now: float) -> None:
        """Node events, but never at the cost of the pass: the announced bucket is a stream of its own
        (an election or a timeout there leaves the other buckets healthy), and placement and routing
        must go on while it is away. Said once per streak; what was not announced is next pass's
        difference, so nothing is lost by skipping."""
        try:
            try:
                await self.announce_nodes(now)
            except FencedAbove as e:
                lease = self.leadership.lease
                if not await lease.confirm():
                    raise  # a successor leads: step down
                # Still ours, so no successor wrote that fence: it is from before the leader bucket was
                # made again. Stepping down would change nothing (every tick would raise again).
                log.error(
                    "%s, yet the lease is still ours: the leader bucket was made again (its revisions "
                    "began again), so that fence is from before; overwriting the record under fence %d",
                    e,
                    lease.fence,
                )
                await self.announced.overrule(lease.fence)
        except (nats.errors.Error, TimeoutError) as e:
            if not self._announce_failing:
                log.warning("node events not announced (%s): passing without them, retrying each pass", e)
            self._announce_failing = True
            return
        if self._announce_failing:
            log.info("node events announced again")
        self._announce_failing = False

    async def announce_nodes(self, now: float) -> None:
        """Announce every difference between the announced node state and ours, under the fence."""
        nodes, lost_s = self.tables.state.nodes, self.s.node_lost_s

        def reporting(n: str) -> bool:
            r = nodes[n]
            return r.heard and now - r.seq_at < lost_s

        lost = {n for n, r in nodes.items() if r.health is NodeState.LOST}
        judged = Judged(lost=lost, known=nodes, reporting=reporting)
        fence = self.leadership.fence
        if self.events.dropped != self._dropped_seen:
            # Events went unpublished for good since (the queue's bound, while the events stream was
            # away and this bucket was not): the record's unsent may hold node events among them, so
            # it is read again, which republishes them, and not cleared before they went out.
            self._dropped_seen = self.events.dropped
            self.announced.resend()
        made = await self.announced.announce(judged, fence, now, self.s.node_forget_s)
        queued = {e.id for e in self.events.pending}
        await self.events.publish(e for e in made if e.id not in queued)
        if self.events.dropped == self._dropped_seen and not self.events.pending:
            await self.announced.sent(fence)

    # ------------------------------------------------------------ one pass

    async def pass_once(self, now: float) -> Plan:
        t0 = time.perf_counter()
        snap = self.tables.state.snapshot(now)
        t1 = time.perf_counter()
        inputs = self.autoscale.inputs(snap, idle_lookup(self.idle, now))
        sched = schedule(snap, self.memo, inputs, self.policy)
        self.memo, plan, scale = sched.memo, sched.plan, sched.scale
        self.autoscale.record(sched, snap)
        # LoRA adapters (issue 33): which replica loads which; written on shard 0's assignment.
        self.autoscale.adapters.decide(snap, inputs.demand, self.tables.assignments.adapters)
        if sched.evicted:
            self.tables.passes.request(PassReason.ROOM_FREED)  # place the wanted replica on the next pass
        self.last_reconcile_ms = (time.perf_counter() - t1) * 1000
        if await self.apply_plan(plan, now):
            snap = self.tables.state.snapshot(now)
        v = self.verdicts
        v.unplaceable = {m: u.summary for m, u in plan.unplaceable.items()}
        v.backoff = {
            m: f"crash loop: {b.failures} failure(s), last: {b.reason}; next attempt at "
            f"{time.strftime('%H:%M:%S', time.localtime(b.until))}"
            for m, b in plan.backoff.items()
        }
        why = {**v.unplaceable, **v.backoff}
        waking, cold = self.autoscale.waking(), self.autoscale.cold()
        wanted = tuple(sorted(scale.wanted.items()))
        key = (self.tables.state.version, why, waking, cold, wanted)
        events: list[Event] = []
        if key != self._routing_key:
            # Only when the snapshot or the reasons changed: a steady pass skips this entirely.
            endpoints, unavailable = routing_content(snap, why, scale.wanted)
            coming, cold_now = coming_content(snap, endpoints, waking, cold)
            for m in cold_now:
                p = snap.catalog.get(m)
                unavailable[m] = cold_reason(p.idle_after if p is not None else None)
            v.reasons = unavailable
            await self.tables.routing.publish_endpoints(endpoints, unavailable, coming, cold_now)
            self._routing_key = key
        # Every pass, not only on change: a model becomes down by time alone (its watch budget).
        ready, budgets, silent = watch_inputs(snap)
        # Watched LoRA adapters (issue 33): down when their base is, or when they fail to load on it.
        a_ready, a_budgets, a_why = adapter_watch(snap, self.autoscale.adapters.seen(snap))
        ready, budgets, silent = {**ready, **a_ready}, {**budgets, **a_budgets}, {**silent, **a_why}
        # A watched model allowed to scale to zero is not down while cold, nor are its adapters.
        cold_adapters = {a.name for a in snap.catalog.adapters if a.base in cold}
        budgets = {m: b for m, b in budgets.items() if m not in cold and m not in cold_adapters}
        events += self.detector.models(ready, budgets, {**v.reasons, **silent}, now)
        events += self.detector.placement(v.unplaceable, now)
        events += self.autoscale.events(snap)
        await self.events.publish(events)
        self.passes += 1
        self.pass_ms.append((time.perf_counter() - t0) * 1000)
        self.on_pass(self.pass_ms[-1] / 1000)
        return plan

    async def apply_plan(self, plan: Plan, now: float) -> bool:
        """Records, then assignments (only those that changed), under the lease. True when tables changed."""
        st = self.tables.state
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
        adapters = self.autoscale.adapters.loads_for(st.catalog)
        if st.generation == self._synced_generation and adapters == self._adapters_synced:
            return plan.changes
        desired = self.desired_assignments(adapters)
        pending = self.tables.assignments.pending(desired)
        lease = self.leadership.lease
        if not await lease.confirm():
            raise Fenced("the lease was lost before writing")
        await self.tables.records.sync(st.replicas)
        items = list(pending.items())
        for i in range(0, len(items), WRITE_BATCH):
            batch = items[i : i + WRITE_BATCH]
            await asyncio.gather(*(self.tables.assignments.write(n, sh, lease.fence, now) for n, sh in batch))
        self._synced_generation = st.generation
        self._adapters_synced = adapters
        return True

    def desired_assignments(
        self, adapters: Mapping[str, tuple[AdapterLoad, ...]] | None = None
    ) -> dict[str, NodeShards]:
        gen = self.tables.state.generation
        if adapters is None:
            adapters = self.autoscale.adapters.loads_for(self.tables.state.catalog)
        if self._desired_cache is None or self._desired_cache[:2] != (gen, adapters):
            addresses = {n: r.address for n, r in self.tables.state.nodes.items()}
            self._desired_cache = (
                gen,
                dict(adapters),
                compute_assignments(
                    self.tables.state.replicas, self.tables.state.catalog, addresses, adapters
                ),
            )
        return self._desired_cache[2]
