"""Who acts: the lease holder leads; every other control plane stands by with warm tables.

The lease (:mod:`leader`) is stepped every TTL/3. Won, it is a takeover: load what the previous leader
(or this process before a restart) wrote — replica records, assignments (the base of the next diff, so
nothing is rewritten), the stored catalog and marks, the routing table — adopt replicas found only in
assignments, then lead: the reconcile loop passes and the ctl service answers. Lost (not renewed in
time, or a write refused by its fence), this process steps down at once and only ingests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import nats.errors
from nats.aio.client import Client as NATS

from llmgw_common.messages import Assignment, ReplicaRecord
from llmgw_common.messages import ShardPlacement as RecordShard
from llmgw_controlplane.apply import AssignmentWriter, ReplicaStore, RoutingPublisher, pin_specs
from llmgw_controlplane.desired import DesiredState
from llmgw_controlplane.events import EventDetector
from llmgw_controlplane.leader import Lease, LeaseLost
from llmgw_controlplane.state import ClusterState

if TYPE_CHECKING:
    from llmgw_controlplane.api import CtlApi
    from llmgw_controlplane.autoscale import Autoscaler
    from llmgw_controlplane.reconcile_loop import Settling
    from llmgw_controlplane.wakes import WakeResponder

log = logging.getLogger("llmgw.controlplane")


class Leadership:
    """The lease loop, the takeover and the step-down; ``leader`` is whether this process acts now."""

    def __init__(
        self,
        lease: Lease,
        *,
        nc: NATS,
        api: CtlApi,
        wakes: WakeResponder,
        autoscale: Autoscaler,
        state: ClusterState,
        desired: DesiredState,
        records: ReplicaStore,
        assignments: AssignmentWriter,
        routing: RoutingPublisher,
        detector: EventDetector,
        settling: Settling,
        new_tenure: Callable[[], None],
        clock: Callable[[], float],
        dirty: asyncio.Event,
    ) -> None:
        self.lease = lease
        self.nc = nc
        self.api = api
        # Wakes are answered only while leading, like the ctl verbs (issue 13).
        self.wakes = wakes
        self.autoscale = autoscale
        self.state = state
        self.desired = desired
        self.records = records
        self.assignments = assignments
        self.routing = routing
        self.detector = detector
        self.settling = settling
        # The reconcile loop forgets what it wrote in an earlier tenure (it is built after this object).
        self.new_tenure = new_tenure
        self.clock = clock
        self.dirty = dirty
        self.leader = False

    @property
    def fence(self) -> int:
        return self.lease.fence

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            held = await self.lease.step()
            if held and not self.leader:
                try:
                    await self.lease.while_renewing(self.take_over())
                except (nats.errors.Error, TimeoutError, LeaseLost) as e:
                    log.warning("taking over failed (%s): retrying", e)
                    await self.step_down()
            elif not held and self.leader:
                await self.step_down()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.lease.renew_every_s)

    async def take_over(self) -> None:
        """Load what the previous leader (or this process before a restart) wrote, then act."""
        now = self.clock()
        records = await self.records.load()
        current = await self.assignments.load()
        adopted = adopt_from_assignments(records, current, now)
        if adopted:
            log.info("adopted %d replica(s) found only in assignments", len(adopted))
            records.update(adopted)
        for rec in records.values():
            for sp in rec.shards:
                self.state.know_node(sp.node, now)
        await self.desired.reload_catalog()
        self.state.set_replicas(pin_specs(records, self.state.catalog))
        self.new_tenure()
        self.detector.new_tenure()
        self.autoscale.new_tenure()
        await self.routing.load()
        await self.desired.load_marks()
        await self.routing.publish_catalog(self.state.catalog)
        self.state.catalog_version = max(self.state.catalog_version, self.routing.catalog_version)
        self.settling.from_start()
        self.state.set_observed_from(self.settling.started_at)
        self.leader = True
        await self.api.start(self.nc)
        await self.wakes.start(self.nc)
        log.info(
            "leading (fence %d): %d replica record(s), %d assignment(s); reconciling from %.1fs",
            self.lease.fence,
            len(records),
            len(current),
            max(0.0, self.settling.until - now),
        )
        self.dirty.set()

    async def step_down(self) -> None:
        if self.leader:
            log.warning("no longer leading: stopped acting")
        self.leader = False
        await self.api.stop()
        await self.wakes.stop()

    async def release(self) -> None:
        """Give the lease up (shutting down) so that a standby takes over at once."""
        if self.leader:
            await self.lease.release()
        self.leader = False


def adopt_from_assignments(
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
