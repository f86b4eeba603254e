"""Typed messages that cross the bus. Every payload on a subject or in a bucket is one of these, or one of
:mod:`llmgw_common.router_messages` (what routers report, and their wake requests).

Messages are frozen pydantic models that ignore unknown fields (open world: a newer sender never
breaks an older reader). They are encoded by :mod:`llmgw_common.codec`, which adds the schema version.

Conventions: times are UNIX seconds (float) stamped by the sender; a receiver judges freshness by its
own clock. ``None`` means "not known" and is never interchangeable with zero (ARCHITECTURE #1, #3).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmgw_common.catalog import CacheRouting, Catalog, ModelProfile
from llmgw_common.names import NodeName, RouterId


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# ---------------------------------------------------------------- inventory


class GpuInfo(Message):
    index: int
    uuid: str
    name: str
    gpu_class: str
    memory_mb: int
    healthy: bool = True
    # Why the GPU is excluded, in an operator's words ("XID 79 seen", "uncorrectable ECC errors: 3").
    reasons: tuple[str, ...] = ()


class WeightsEntry(Message):
    """One model's weights found on a node."""

    name: str
    path: str
    shared: bool
    # For shared storage: the mount source ("filer1:/models"), so that one filer is counted once.
    filer_id: str | None = None
    size_bytes: int | None = None


class StorageReport(Message):
    # False when the agent was told no directories: it did not look, which is not "found nothing".
    looked: bool = False
    weights: tuple[WeightsEntry, ...] = ()
    # Directories that were configured but could not be read, with the reason.
    problems: tuple[str, ...] = ()


class Inventory(Message):
    node: NodeName
    boot_id: str
    sent_at: float
    address: str = "127.0.0.1"
    gpus: tuple[GpuInfo, ...] = ()
    # MemTotal in GB, or None when it could not be read: never 0 for "unknown".
    memory_gb: float | None = None
    cpus: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    fabric: str | None = None
    engines: tuple[str, ...] = ()
    storage: StorageReport = StorageReport()
    simulated: bool = False


# ---------------------------------------------------------------- shards


class ShardState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


class ShardReport(Message):
    replica_id: str
    shard: int
    model: str
    state: ShardState
    port: int | None = None
    pid: int | None = None
    error: str | None = None
    since: float | None = None


class Heartbeat(Message):
    node: NodeName
    boot_id: str
    seq: int
    sent_at: float
    address: str = "127.0.0.1"
    shards: tuple[ShardReport, ...] = ()


class ShardStatus(Message):
    """A shard's state change, sent when it happens (heartbeats repeat the state every tick)."""

    node: NodeName
    boot_id: str
    sent_at: float
    replica_id: str
    shard: int
    model: str
    state: ShardState
    port: int | None = None
    error: str | None = None
    # The engine's last lines of output when it failed.
    log_tail: tuple[str, ...] = ()


class ReplicaLoad(Message):
    replica_id: str
    shard: int = 0
    # None: the engine does not expose it (a current llama.cpp has no KV metric): blank, never 0.
    running: float | None = None
    waiting: float | None = None
    kv_use: float | None = None
    # The engine's own prefix-cache counters since it started, in tokens (vLLM's
    # vllm:prefix_cache_queries_total / _hits_total); None where it exposes none.
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    # LoRA adapters (issue 33), on shard 0's line: loaded and serving; with requests running or waiting
    # (vLLM's vllm:lora_requests_info running_lora_adapters, waiting_lora_adapters: never unloaded); and
    # adapter name -> why its last load failed, in the user's terms (missing weights, rank too large).
    adapters: tuple[str, ...] = ()
    adapters_busy: tuple[str, ...] = ()
    adapter_errors: dict[str, str] = Field(default_factory=dict)


class LoadReport(Message):
    node: NodeName
    sent_at: float
    # The lines due (issue 34): a replica's when its load changed (at most every 250 ms) or once a
    # heartbeat unchanged, not every replica of the node each time: a reader keeps the newest per replica.
    replicas: tuple[ReplicaLoad, ...] = ()


# ---------------------------------------------------------------- assignments


class AdapterLoad(Message):
    """One LoRA adapter a replica must have loaded (``AdapterProfile`` as the engine needs it)."""

    name: str
    weights: str
    rank: int | None = None


class ShardAssignment(Message):
    replica_id: str
    shard: int
    shards: int = 1
    model: str
    engine: str
    weights: str | None = None
    gpus: tuple[int, ...] = ()
    port: int
    # host:port of shard 0 for multi-node replicas; None for single-node ones.
    leader: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = 600.0
    # Engine-specific options from the catalog profile (e.g. the simulator's timing).
    options: dict[str, Any] = Field(default_factory=dict)
    # The profile's routing by cached prefix (None: the engine's default): whether the engine publishes
    # its KV-cache events for the agent to relay.
    cache_routing: CacheRouting | None = None
    # LoRA (issue 33): the base profile's engine flags, None for a profile that serves no adapters (then
    # all three are None). Like every field above, a change restarts the engine.
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    # The adapters this replica must have loaded, on shard 0. Declarative: the agent loads missing ones
    # and unloads extra ones through the engine's runtime API, and loads them again after a restart.
    # Never part of what restarts an engine (the agent's fingerprint of a shard leaves it out).
    adapters: tuple[AdapterLoad, ...] = ()


class Assignment(Message):
    """What one node must run. The agent converges to it; it is re-read, never replayed."""

    node: str
    # The leader lease revision under which this was written: a fencing token.
    fence: int = 0
    written_at: float = 0.0
    shards: tuple[ShardAssignment, ...] = ()


# ---------------------------------------------------------------- routing


class Endpoint(Message):
    replica_id: str
    model: str
    url: str
    node: str
    # Draining endpoints take no new requests but finish what they hold.
    draining: bool = False


class RoutingEndpoints(Message):
    version: int
    endpoints: dict[str, tuple[Endpoint, ...]] = Field(default_factory=dict)
    # For catalog models without a ready endpoint: why, in the user's terms (the 503 reason).
    unavailable: dict[str, str] = Field(default_factory=dict)
    # Models without a ready endpoint for which a replica is on its way (starting, replacing a failed or
    # drained one, waking): routers hold such requests up to the model's ``queue_timeout_s`` instead of
    # refusing them. Model -> what is coming, in the user's terms. A model absent here and from
    # ``endpoints`` has nothing coming: refuse at once with its ``unavailable`` reason.
    coming: dict[str, str] = Field(default_factory=dict)
    # Models scaled to zero (catalog ``min_replicas: 0``, idle past ``idle_after``): a request for one
    # is held while the router asks the control plane to wake it (``router_messages.WakeRequest``).
    cold: tuple[str, ...] = ()


class RoutingCatalog(Message):
    version: int
    catalog: Catalog


# ---------------------------------------------------------------- durable records


class ShardPlacement(Message):
    shard: int
    node: str
    gpus: tuple[int, ...] = ()
    port: int


# What of a profile a running replica depends on: changing any of these replaces its replicas (one at a
# time); changing anything else (replicas, admission limits, watch) leaves them running.
SPEC_FIELDS = (
    "engine",
    "args",
    "env",
    "startup_timeout_s",
    "options",
    "gpu_class",
    "gpus_per_node",
    "nodes",
    "min_memory_gb",
    "node_selector",
    # The engine's flags follow it (KV events on or off).
    "cache_routing",
    # LoRA's engine flags (issue 33). The adapters themselves are not here: adding one restarts nothing.
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
)


class ReplicaSpec(Message):
    """The part of its model's profile a replica was placed and started with; its assignment is built
    from this, not from the current catalog, so a catalog change never restarts a running replica."""

    engine: str
    weights: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = 600.0
    options: dict[str, Any] = Field(default_factory=dict)
    gpu_class: str | None = None
    gpus_per_node: int | None = None
    nodes: int = 1
    min_memory_gb: float | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    cache_routing: CacheRouting | None = None
    max_loras: int | None = None
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @classmethod
    def of(cls, profile: ModelProfile) -> ReplicaSpec:
        return cls(weights=profile.weights_name, **{f: getattr(profile, f) for f in SPEC_FIELDS})

    def matches(self, profile: ModelProfile) -> bool:
        """Whether a replica started with this spec is what ``profile`` asks for (no object built)."""
        if self.weights != profile.weights_name:
            return False
        return all(getattr(self, f) == getattr(profile, f) for f in SPEC_FIELDS)


class ReplicaRecord(Message):
    id: str
    model: str
    created: float
    shards: tuple[ShardPlacement, ...]
    # None: a record from before specs were kept; the control plane pins it to the catalog when it leads.
    spec: ReplicaSpec | None = None
    # True once a drain replaced it: routers stop sending new requests when its replacement serves.
    draining: bool = False
    draining_since: float | None = None


class Limits(Message):
    """Limits of a key or a team; None: no limit of that kind. Windows are fixed and aligned to the UTC
    minute, day and month. Tokens are prompt + completion as the answers' ``usage`` says."""

    rpm: int | None = Field(default=None, gt=0)
    tpm: int | None = Field(default=None, gt=0)
    concurrency: int | None = Field(default=None, gt=0)
    daily_tokens: int | None = Field(default=None, gt=0)
    monthly_tokens: int | None = Field(default=None, gt=0)

    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in LIMIT_FIELDS)


LIMIT_FIELDS = ("rpm", "tpm", "concurrency", "daily_tokens", "monthly_tokens")


class KeyLimits(Limits):
    """Limits over every model, and per model (a model's entry applies to it in addition: a request is
    admitted only within both)."""

    models: dict[str, Limits] = Field(default_factory=dict)

    def empty(self) -> bool:
        return Limits.empty(self) and all(m.empty() for m in self.models.values())


class CacheScope(StrEnum):
    """With whom a key's requests may share cached prompt prefixes on an engine. Prefix-cache timing is
    a side channel between tenants (a hit answers faster), so a key that must not leak, or learn,
    what others send is kept apart: the router gives its requests a ``cache_salt`` (vLLM's) of its own."""

    SHARED = "shared"  # with every key (the default: most reuse)
    TEAM = "team"  # with the keys of its team only
    KEY = "key"  # with no other key


class ApiKeyRecord(Message):
    id: str
    name: str
    # sha256 of the key; the key itself is printed once and never stored.
    hash: str
    models: tuple[str, ...] | None = None
    created: float
    expires: float | None = None
    revoked: bool = False
    # None (every record from before tenancy): unlimited.
    limits: KeyLimits | None = None
    # A team whose limits (a TeamRecord, key ``team.<name>`` in the same bucket) its keys share.
    team: str | None = None
    # Fair queueing: a key's share of a saturated model's slots, against other waiting keys.
    weight: float = Field(default=1.0, gt=0)
    cache_scope: CacheScope = CacheScope.SHARED

    @property
    def limited(self) -> bool:
        return self.limits is not None or self.team is not None


# Key of a team's record in ``<prefix>_keys``: key ids start with ``k-``, so they never collide.
TEAM_KEY_PREFIX = "team."


class TeamRecord(Message):
    """Limits shared by every key of one team (``ApiKeyRecord.team``)."""

    name: str
    limits: KeyLimits = KeyLimits()
    created: float = 0.0


class Marks(Message):
    """Operator marks on nodes, kept in ``llmgw_desired``."""

    cordoned: tuple[str, ...] = ()
    # node -> deadline (UNIX seconds) by which its replicas are stopped whatever happens.
    draining: dict[str, float] = Field(default_factory=dict)


class Webhook(Message):
    url: str
    format: str = "json"  # "json" or "slack"
    events: tuple[str, ...] | None = None  # None: every kind
    secret: str | None = None


class ClusterSettings(Message):
    """Cluster-wide settings in ``llmgw_desired`` key ``settings``."""

    webhooks: tuple[Webhook, ...] = ()


# ---------------------------------------------------------------- events


class Event(Message):
    id: str
    kind: str  # node.lost, model.down, ...: every kind is in llmgw_common.event_details.DETAILS
    subject: str  # the node or model it is about
    time: float
    summary: str = ""
    # Open on the wire (a newer sender may add keys); built and read through the kind's typed model in
    # llmgw_common.event_details, never with .get().
    details: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------- durable usage


class UsageHour(Message):
    """One router incarnation's whole totals for one UTC hour, in KV ``llmgw_usage`` (key: see
    ``llmgw_runtime.usage_ledger.ledger_key``). Rewritten as the hour's counts grow; never an increment,
    so a rewrite or a repeat counts nothing twice (why: ``usage_ledger``)."""

    v: int = 1
    router: RouterId
    since: float  # the incarnation: the router's start
    hour: float  # the hour's start, UNIX seconds
    written_at: float
    # key id -> model -> [requests, prompt tokens, completion tokens]
    usage: dict[str, dict[str, tuple[int, int, int]]] = Field(default_factory=dict)
