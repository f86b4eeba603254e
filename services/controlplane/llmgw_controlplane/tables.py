"""What the lease loop and the reconcile loop both work on: the tables, their stored copies, the clock.

A takeover (:mod:`leadership`) loads the stored records, assignments and routing table into the
in-memory tables and opens the settling window; the loop (:mod:`reconcile_loop`) judges and passes
over the same tables and writes the same stores. Built once by :class:`ControlPlane` (``service.py``)
and handed to both, so that neither constructor repeats the other's list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmgw_controlplane.apply import AssignmentWriter, ReplicaStore
from llmgw_controlplane.pass_requests import PassRequests
from llmgw_controlplane.routing_publisher import RoutingPublisher
from llmgw_controlplane.settling import Settling
from llmgw_controlplane.state import ClusterState


@dataclass(frozen=True, slots=True)
class Tables:
    """The in-memory tables, the writers of their stored copies, and what times and wakes the loop."""

    # Node and replica tables, as reports and the leader's writes left them.
    state: ClusterState
    # When the loop may judge and act (bus up, reports had time to arrive).
    settling: Settling
    # The stored copies: llmgw_replicas, llmgw_assign, llmgw_routing.
    records: ReplicaStore
    assignments: AssignmentWriter
    routing: RoutingPublisher
    # Our own clock, which every judgement uses.
    clock: Callable[[], float]
    # Asked when something changed that a pass must see: the loop turns before its tick.
    passes: PassRequests
