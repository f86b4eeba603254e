"""The reconcile loop: one turn every ``tick_s``, or sooner when ingest marked news.

A turn judges node health by our own clock (leader or not: a standby's tables stay warm). The leader
also publishes node events and, once reports had time to arrive, passes: snapshot -> :func:`reconcile`
(pure) -> :meth:`ReconcileLoop.apply_plan` (the one writer of replica records and assignments, under
the lease) -> routing endpoints (only on change) -> model and placement events. A pass that raises is
counted by a :class:`PassGuard`; too many in a row end the loop, and so the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors

from llmgw_common.messages import Event, ReplicaRecord
from llmgw_common.messages import ShardPlacement as RecordShard
from llmgw_common.runtime import PassGuard
from llmgw_common.settings import ControlPlaneSettings
from llmgw_controlplane.apply import AssignmentWriter, Fenced, NodeShards, ReplicaStore, RoutingPublisher
from llmgw_controlplane.apply import desired_assignments as compute_assignments
from llmgw_controlplane.autoscale import Autoscaler, idle_lookup
from llmgw_controlplane.events import EventDetector, EventPublisher, watch_inputs
from llmgw_controlplane.failures import FailureBook, failed_replica
from llmgw_controlplane.idle import IdleMerger
from llmgw_controlplane.ingest import Ingest
from llmgw_controlplane.leadership import Leadership
from llmgw_controlplane.plan import Plan, ReconcileMemo
from llmgw_controlplane.reconciler import reconcile
from llmgw_controlplane.routing import cold_reason, coming_content, routing_content
from llmgw_controlplane.state import ClusterState

log = logging.getLogger("llmgw.controlplane")

WRITE_BATCH = 64
# Reconcile passes failing in a row (a bug, not the bus), for at least one lease TTL, before the loop
# gives up: the process exits, giving the lease up, so that a standby (or the restarted process, with
# fresh state) takes over.
MAX_FAILED_PASSES = 10


@dataclass(slots=True)
class Settling:
    """When the loop may judge and act: never while this process is cut off from NATS (heartbeats
    cannot arrive, so no node's silence may be judged), and only once reports had ``settle_s`` to arrive
    after it began listening (or came back)."""

    settle_s: float
    # When this process began listening (own clock).
    started_at: float
    until: float = 0.0
    # False while this process is cut off from NATS (ARCHITECTURE: a lost command or reconnect must
    # not leave nodes wrong).
    bus_up: bool = True

    def listening_from(self, t: float) -> None:
        self.started_at = t
        self.until = t + self.settle_s

    def from_start(self) -> None:
        """A takeover: reports are awaited from when this process began listening, so a standby that
        has listened that long already acts at once."""
        self.until = self.started_at + self.settle_s

    def bus_back(self, now: float) -> None:
        self.until = max(self.until, now + self.settle_s)
        self.bus_up = True


@dataclass(slots=True)
class Verdicts:
    """What the last pass found of models it could not serve (ctl replies and the console read them)."""

    # model -> why no placement fits
    unplaceable: dict[str, str] = field(default_factory=dict)
    # model -> its crash loop and when the next attempt is due
    backoff: dict[str, str] = field(default_factory=dict)
    # model -> why it is not routed, in the user's terms (what the routing table says)
    reasons: dict[str, str] = field(default_factory=dict)


class ReconcileLoop:
    """Turns of the loop, and the one writer of replica records and assignments."""

    def __init__(
        self,
        s: ControlPlaneSettings,
        *,
        state: ClusterState,
        idle: IdleMerger,
        detector: EventDetector,
        failures: FailureBook,
        autoscale: Autoscaler,
        ingest: Ingest,
        leadership: Leadership,
        settling: Settling,
        records: ReplicaStore,
        assignments: AssignmentWriter,
        routing: RoutingPublisher,
        events: EventPublisher,
        clock: Callable[[], float],
        dirty: asyncio.Event,
    ) -> None:
        self.s = s
        self.state = state
        self.idle = idle
        self.detector = detector
        self.failures = failures
        self.autoscale = autoscale
        self.ingest = ingest
        self.leadership = leadership
        self.settling = settling
        self.records = records
        self.assignments = assignments
        self.routing = routing
        self.events = events
        self.clock = clock
        self.dirty = dirty
        self.memo = ReconcileMemo()
        self.verdicts = Verdicts()
        self.guard = PassGuard("reconcile", log, limit=MAX_FAILED_PASSES, min_span_s=s.lease_ttl_s)
        self.passes = 0
        self.pass_ms: deque[float] = deque(maxlen=200)
        self.last_reconcile_ms = 0.0
        # What this tenure wrote, so that a steady pass writes nothing: reset by new_tenure().
        self._desired_cache: tuple[int, dict[str, NodeShards]] | None = None
        self._synced_generation = -1
        self._routing_key: tuple[int, dict[str, str], dict[str, str], tuple[str, ...]] | None = None

    def new_tenure(self) -> None:
        """Forget what was written while leading before: a new tenure writes from what it loaded."""
        self._desired_cache = None
        self._synced_generation = -1
        self._routing_key = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.dirty.wait(), self.s.tick_s)
            self.dirty.clear()
            if stop.is_set():
                return
            try:
                await self.tick(self.clock())
            except (nats.errors.Error, TimeoutError) as e:
                log.warning("reconcile pass could not write (%s): retrying next tick", e)
            except Exception as e:  # one bad input must not stop reconciling; the guard gives up at its limit
                self.guard.failure(e)
            else:
                self.guard.ok()

    async def tick(self, now: float) -> None:
        """One turn of the loop: judge nodes; the leader also publishes events and, once settled, passes."""
        if not self.settling.bus_up:
            return
        transitions = self.state.judge(now)
        node_events = self.detector.nodes(transitions, now)
        for name in self.state.forget_silent(now, self.s.node_forget_s):
            self.detector.forget_node(name)
            self.ingest.forget(name)
            log.warning(
                "node %s forgotten: lost for over %gs with no replica on it", name, self.s.node_forget_s
            )
        self.idle.prune(now)
        self.state.prune_reports()
        lead = self.leadership
        if not lead.leader:
            return
        if not lead.lease.held():
            await lead.step_down()
            return
        await self.events.publish(node_events)
        if now < self.settling.until:
            return
        try:
            await self.pass_once(now)
        except Fenced as e:
            log.warning("write refused (%s): another control plane leads", e)
            await lead.step_down()

    # ------------------------------------------------------------ one pass

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
        v = self.verdicts
        v.unplaceable = {m: u.summary for m, u in plan.unplaceable.items()}
        v.backoff = {
            m: f"crash loop: {b.failures} failure(s), last: {b.reason}; next attempt at "
            f"{time.strftime('%H:%M:%S', time.localtime(b.until))}"
            for m, b in plan.backoff.items()
        }
        why = {**v.unplaceable, **v.backoff}
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
            v.reasons = unavailable
            await self.routing.publish_endpoints(endpoints, unavailable, coming, cold_now)
            self._routing_key = key
        # Every pass, not only on change: a model becomes down by time alone (its watch budget).
        ready, budgets, silent = watch_inputs(snap)
        # A watched model allowed to scale to zero is not down while cold.
        budgets = {m: b for m, b in budgets.items() if m not in cold}
        events += self.detector.models(ready, budgets, {**v.reasons, **silent}, now)
        events += self.detector.placement(v.unplaceable, now)
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
        lease = self.leadership.lease
        if not await lease.confirm():
            raise Fenced("the lease was lost before writing")
        await self.records.sync(st.replicas)
        items = list(pending.items())
        for i in range(0, len(items), WRITE_BATCH):
            batch = items[i : i + WRITE_BATCH]
            await asyncio.gather(*(self.assignments.write(n, sh, lease.fence, now) for n, sh in batch))
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
