"""Who acts: the lease holder leads; every other control plane stands by with warm tables.

The lease (:mod:`leader`) is stepped every TTL/3. Won, it is a takeover: load what the previous leader
(or this process before a restart) wrote — replica records, assignments (the base of the next diff, so
nothing is rewritten), the stored catalog and marks, the routing table — adopt replicas found only in
assignments, then lead: the reconcile loop passes and the ctl service answers. Lost (not renewed in
time, or a write refused by its fence), this process steps down at once and only ingests.

A control plane whose lease calls go unanswered for a whole TTL while its server still answers pings
is on an island (a nats-server cut from its peers: its JetStream says 503, and no client leaves a
server that answers pings): it moves to another of its servers (:func:`leave_if_stranded`), so that
two control planes on one cut server do not leave the cluster without a leader until the heal.
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
from llmgw_controlplane.apply import pin_specs
from llmgw_controlplane.desired import DesiredState
from llmgw_controlplane.leader import Lease, LeaseLost
from llmgw_controlplane.pass_requests import PassReason
from llmgw_controlplane.scheduler.routing import takeover_content
from llmgw_controlplane.tables import Tables

if TYPE_CHECKING:
    from llmgw_controlplane.api import CtlApi
    from llmgw_controlplane.wakes import WakeResponder

log = logging.getLogger("llmgw.controlplane")


class Leadership:
    """The lease loop, the takeover and the step-down; ``leader`` is whether this process acts now."""

    def __init__(
        self,
        lease: Lease,
        tables: Tables,
        *,
        nc: NATS,
        api: CtlApi,
        wakes: WakeResponder,
        desired: DesiredState,
    ) -> None:
        self.lease = lease
        self.tables = tables
        self.nc = nc
        self.api = api
        # Wakes are answered only while leading, like the ctl verbs (issue 13).
        self.wakes = wakes
        self.desired = desired
        # Run in this order at each takeover, once the loaded replicas are in the tables: each forgets
        # what it remembered of an earlier tenure (service.py registers the reconcile loop's, then the
        # event detector's, then the autoscaler's).
        self.on_new_tenure: list[Callable[[], None]] = []
        self.leader = False
        # The stored table's cold models, while its takeover rewrite is still to come (None: done, or
        # none stored).
        self.table_due: tuple[str, ...] | None = None

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
                late = self.lease.unrenewed_s()
                if late is not None:
                    # Held no longer without a refusal: renewals came too late (a starved event loop),
                    # so a standby may take over; say it, or the step-down has no cause in the log.
                    log.warning(
                        "lease last renewed %.1fs ago, past %.1fs: stepping down",
                        late,
                        self.lease.ttl_s * 0.8,
                    )
                await self.step_down()
            if not held:
                await leave_if_stranded(self.lease, self.nc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.lease.renew_every_s)

    async def take_over(self) -> None:
        """Load what the previous leader (or this process before a restart) wrote, then act."""
        now = self.tables.clock()
        records = await self.tables.records.load()
        current = await self.tables.assignments.load()
        adopted = adopt_from_assignments(records, current, now)
        if adopted:
            log.info("adopted %d replica(s) found only in assignments", len(adopted))
            records.update(adopted)
        for rec in records.values():
            for sp in rec.shards:
                self.tables.state.know_node(sp.node, now)
        await self.desired.reload_catalog()
        self.tables.state.set_replicas(pin_specs(records, self.tables.state.catalog))
        for forget in self.on_new_tenure:
            forget()
        await self.tables.routing.load()
        await self.desired.load_marks()
        await self.tables.routing.publish_catalog(self.tables.state.catalog)
        self.tables.state.catalog_version = max(
            self.tables.state.catalog_version, self.tables.routing.catalog_version
        )
        self.tables.settling.from_start()
        self.tables.state.set_observed_from(self.tables.settling.started_at)
        # A stored table names the previous writer's endpoints, which nothing here may have confirmed
        # (issue 25: a warm `compose up` answered 502): rewritten by rewrite_taken_table, not at the
        # first pass settle_s on.
        self.table_due = self.tables.routing.stored_cold
        self.leader = True
        await self.api.start(self.nc)
        await self.wakes.start(self.nc)
        log.info(
            "leading (fence %d): %d replica record(s), %d assignment(s); reconciling from %.1fs",
            self.lease.fence,
            len(records),
            len(current),
            max(0.0, self.tables.settling.until - now),
        )
        self.tables.passes.request(PassReason.TENURE)

    async def rewrite_taken_table(self, now: float, listen_s: float) -> bool:
        """The takeover's rewrite of the stored table, once this process has listened ``listen_s``
        (a heartbeat period and a margin); True when written now. Earlier, no agent had a turn to
        report to this process yet: a clean restart (the lease released, taken at once) routed nothing
        and routers held every request until the first pass, settle_s on."""
        cold = self.table_due
        if cold is None or now - self.tables.settling.started_at < listen_s:
            return False
        await self.tables.routing.publish_endpoints(*takeover_content(self.tables.state.snapshot(now), cold))
        self.table_due = None
        return True

    async def step_down(self) -> None:
        if self.leader:
            log.warning("no longer leading: stopped acting")
        self.leader = False
        self.table_due = None
        await self.api.stop()
        await self.wakes.stop()

    async def release(self) -> None:
        """Give the lease up (shutting down) so that a standby takes over at once."""
        if self.leader:
            await self.lease.release()
        self.leader = False


async def leave_if_stranded(lease: Lease, nc: NATS) -> bool:
    """Reconnect to another server when the lease bucket went unanswered for a TTL; True if it did.

    Once a TTL at most (the count starts again), and only with another server to go to: with one, a
    reconnect finds the same island. A server that is merely slow costs one reconnect.
    """
    since = lease.failing_since
    if since is None or lease.clock() - since < lease.ttl_s or len(nc.servers) < 2:
        return False
    url = nc.connected_url
    log.warning(
        "the lease bucket has not answered through %s for %.0fs: moving to another server",
        url.netloc if url is not None else "the server",
        lease.clock() - since,
    )
    lease.failing_since = lease.clock()
    await nc.force_reconnect()
    return True


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
