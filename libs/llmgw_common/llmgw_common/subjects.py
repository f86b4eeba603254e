"""Every NATS subject, KV bucket and stream name llmgw uses, in one place.

All names hang off a prefix (default ``llmgw``) so that two clusters can share one NATS.
"""

from __future__ import annotations

from dataclasses import dataclass

# The one name validator (llmgw_common.names); imported from here by older code.
from llmgw_common.names import check_token

__all__ = ["Subjects", "check_token"]


@dataclass(frozen=True, slots=True)
class Subjects:
    prefix: str = "llmgw"

    def __post_init__(self) -> None:
        check_token(self.prefix, "subject prefix")

    # agent -> control plane / routers
    def heartbeat(self, node: str) -> str:
        return f"{self.prefix}.node.{node}.heartbeat"

    def inventory(self, node: str) -> str:
        return f"{self.prefix}.node.{node}.inventory"

    def status(self, node: str) -> str:
        return f"{self.prefix}.node.{node}.status"

    def load(self, node: str) -> str:
        return f"{self.prefix}.node.{node}.load"

    def inventory_request(self, node: str) -> str:
        """Control plane -> agent: "send your inventory now" (it heard a node it holds no inventory of,
        e.g. after its own restart). The agent answers on its inventory subject; no payload."""
        return f"{self.prefix}.node.{node}.inventory-request"

    def kv(self, node: str) -> str:
        """Agent -> routers: KvDeltas, the node's replicas' KV-cache changes in batches (llmgw_common.kvcache)."""
        return f"{self.prefix}.node.{node}.kv"

    def kv_snapshot(self, node: str) -> str:
        """Router -> agent, request/reply: KvSnapshotRequest -> KvSnapshot, the node's block sets by page."""
        return f"{self.prefix}.node.{node}.kv-snapshot"

    def all_nodes(self, kind: str) -> str:
        """Wildcard over every node for one kind: heartbeat, inventory, status or load."""
        return f"{self.prefix}.node.*.{kind}"

    # router -> control plane
    def idle(self, router: str) -> str:
        return f"{self.prefix}.router.{router}.idle"

    def all_idle(self) -> str:
        return f"{self.prefix}.router.*.idle"

    def wake(self, router: str) -> str:
        """Router -> control plane, request/reply: wake a model scaled to zero (WakeRequest/WakeReply).
        Only the leading control plane answers; a router re-asks while it holds requests."""
        return f"{self.prefix}.router.{router}.wake"

    def all_wake(self) -> str:
        return f"{self.prefix}.router.*.wake"

    def usage(self, router: str) -> str:
        return f"{self.prefix}.router.{router}.usage"

    def all_usage(self) -> str:
        return f"{self.prefix}.router.*.usage"

    def demand(self, router: str) -> str:
        """Router -> control plane, every tick: a DemandReport (what it sees of each model's load)."""
        return f"{self.prefix}.router.{router}.demand"

    def all_demand(self) -> str:
        return f"{self.prefix}.router.*.demand"

    def demand_whole(self) -> str:
        """Control plane -> every router: send your whole demand report at your next tick
        (DemandWholeAsk). A control plane that starts holds nobody's view; without it, reports that
        carry only what changed would leave it blind until each router's minute is up."""
        return f"{self.prefix}.controlplane.demand-whole"

    # ctl micro service
    @property
    def ctl_service(self) -> str:
        return f"{self.prefix}-ctl"

    @property
    def ctl_prefix(self) -> str:
        return f"{self.prefix}.ctl"

    def ctl(self, verb: str) -> str:
        return f"{self.prefix}.ctl.{verb}"

    # events
    def event(self, kind: str) -> str:
        return f"{self.prefix}.events.{kind}"

    def all_events(self) -> str:
        return f"{self.prefix}.events.>"

    # JetStream
    @property
    def events_stream(self) -> str:
        return f"{self.prefix.upper().replace('-', '_')}_EVENTS"

    @property
    def bucket_assign(self) -> str:
        return f"{self.prefix}_assign"

    @property
    def bucket_routing(self) -> str:
        return f"{self.prefix}_routing"

    @property
    def bucket_desired(self) -> str:
        return f"{self.prefix}_desired"

    @property
    def bucket_replicas(self) -> str:
        return f"{self.prefix}_replicas"

    @property
    def bucket_keys(self) -> str:
        return f"{self.prefix}_keys"

    @property
    def bucket_key_names(self) -> str:
        """Live keys' names -> their ids (``llmgw_runtime.apikeys``): written and read by the CLI only."""
        return f"{self.prefix}_key_names"

    @property
    def bucket_leader(self) -> str:
        return f"{self.prefix}_leader"

    @property
    def bucket_usage(self) -> str:
        return f"{self.prefix}_usage"

    @property
    def bucket_tokenizers(self) -> str:
        """Object store: per model, its tokenizer as the engine uses it (agents write, routers read)."""
        return f"{self.prefix}_tokenizers"

    @property
    def bucket_announced(self) -> str:
        """Control planes only: the node events the cluster announced (``announced.AnnouncedNodes``).
        Without the lease bucket's TTL, so it outlasts a gap with no leader."""
        return f"{self.prefix}_announced"


# Keys inside buckets.
ROUTING_CATALOG = "catalog"
ROUTING_ENDPOINTS = "endpoints"
DESIRED_CATALOG = "catalog"
DESIRED_SETTINGS = "settings"
DESIRED_MARKS = "marks"
LEADER_KEY = "leader"
