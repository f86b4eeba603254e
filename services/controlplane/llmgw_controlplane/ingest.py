"""Reports off the bus into the tables: nodes' heartbeats, inventories, statuses and load reports (their
LoRA adapters only); routers' idle usage and demand reports.

Cheap by design: each callback updates a table and marks the reconcile loop dirty only when something
it cares about changed (a heartbeat repeating the same state does not). A standby ingests exactly as
the leader does, so its tables are warm when it takes over. What a report claims is judged in
:mod:`state` (times, boots, seqs); here only whether it came from the sender it names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from llmgw_common.messages import Heartbeat, Inventory, LoadReport, ShardStatus
from llmgw_common.router_messages import DemandReport, IdleReport, UsageReport
from llmgw_common.subjects import Subjects
from llmgw_controlplane.console.usage import UsageBook
from llmgw_controlplane.pass_requests import PassReason, PassRequests
from llmgw_controlplane.scheduler.adapter_reports import AdapterReports
from llmgw_controlplane.scheduler.demand import DemandBook
from llmgw_controlplane.scheduler.idle import IdleMerger
from llmgw_controlplane.state import ClusterState
from llmgw_runtime import bus

log = logging.getLogger("llmgw.controlplane")


class Ingest:
    """The control plane's subscriptions and what each message does to the tables."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        *,
        state: ClusterState,
        idle: IdleMerger,
        usage: UsageBook,
        drops: bus.DropLog,
        clock: Callable[[], float],
        passes: PassRequests,
        heartbeat_interval_s: float,
        demand: DemandBook | None = None,
        adapters: AdapterReports | None = None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.state = state
        self.idle = idle
        self.usage = usage
        self.drops = drops
        self.clock = clock
        self.passes = passes
        self.heartbeat_interval_s = heartbeat_interval_s
        self.demand = demand
        self.adapters = adapters
        # node -> when we last asked it for its inventory (own clock).
        self._inventory_asked: dict[str, float] = {}

    async def subscribe(self) -> list[Subscription]:
        """Subscribe to every report subject; the caller owns (and unsubscribes) what comes back."""
        sub, nc = self.subjects, self.nc
        return [
            await bus.subscribe(nc, sub.all_nodes("heartbeat"), Heartbeat, self.on_heartbeat, self.drops),
            await bus.subscribe(nc, sub.all_nodes("inventory"), Inventory, self.on_inventory, self.drops),
            await bus.subscribe(nc, sub.all_nodes("status"), ShardStatus, self.on_status, self.drops),
            await bus.subscribe(nc, sub.all_idle(), IdleReport, self.on_idle, self.drops),
            await bus.subscribe(nc, sub.all_usage(), UsageReport, self.on_usage, self.drops),
            await bus.subscribe(nc, sub.all_demand(), DemandReport, self.on_demand, self.drops),
            # LoRA adapters loaded, busy and failed, per replica (issue 33).
            await bus.subscribe(nc, sub.all_nodes("load"), LoadReport, self.on_load, self.drops),
        ]

    def forget(self, node: str) -> None:
        """``node`` was forgotten by the tables: so is when we last asked it for an inventory."""
        self._inventory_asked.pop(node, None)

    def _from_its_subject(self, msg: Msg, sender: str, what: str = "node") -> bool:
        """Whether the node or router a message names is the one its subject names (``<prefix>.<kind>s
        .<sender>.<verb>``): permissions are per subject, so that one is the sender's."""
        parts = msg.subject.split(".")
        if len(parts) < 2 or parts[-2] != sender:
            self.drops.drop(msg.subject, f"claims {what} {sender!r}, not the subject's")
            return False
        return True

    async def on_heartbeat(self, hb: Heartbeat, msg: Msg) -> None:
        if not self._from_its_subject(msg, hb.node):
            return
        now = self.clock()
        if self.state.on_heartbeat(hb, now):
            self.passes.request(PassReason.REPORT)
        if self.state.wants_inventory(hb.node):
            # Its inventory went out before we listened (our restart, or a start race), or it claims a
            # new boot that only an inventory proves: ask, at most once per few heartbeats, instead of
            # holding the node back until its next periodic send.
            asked = self._inventory_asked.get(hb.node, float("-inf"))
            if now - asked >= 3 * self.heartbeat_interval_s:
                self._inventory_asked[hb.node] = now
                await self.nc.publish(self.subjects.inventory_request(hb.node))

    def on_inventory(self, inv: Inventory, msg: Msg) -> None:
        if self._from_its_subject(msg, inv.node) and self.state.on_inventory(inv, self.clock()):
            self.passes.request(PassReason.REPORT)

    def on_status(self, st: ShardStatus, msg: Msg) -> None:
        if self._from_its_subject(msg, st.node) and self.state.on_status(st, self.clock()):
            self.passes.request(PassReason.REPORT)

    def on_usage(self, rep: UsageReport, msg: Msg) -> None:
        if self._from_its_subject(msg, rep.router, "router"):
            self.usage.add(rep, self.clock())

    def on_demand(self, rep: DemandReport, msg: Msg) -> None:
        # Not dirty: the load is judged on the tick, over time (up_after, down_after), not per message.
        if self.demand is not None and self._from_its_subject(msg, rep.router, "router"):
            self.demand.add(rep, self.clock())

    def on_load(self, rep: LoadReport, msg: Msg) -> None:
        # Dirty only when a replica's loaded adapters or their errors changed: a wake is then answered
        # and a held request released from the assignment's point of view.
        if self.adapters is not None and self._from_its_subject(msg, rep.node):
            if self.adapters.add(rep, self.clock()):
                self.passes.request(PassReason.REPORT)

    def on_idle(self, rep: IdleReport, msg: Msg) -> None:
        if self._from_its_subject(msg, rep.router, "router"):
            self.idle.add(rep, self.clock())
