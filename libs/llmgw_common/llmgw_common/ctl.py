"""The management API's contract: typed requests and replies of the ``llmgw.ctl.<verb>`` micro service,
its verbs and its error headers. No I/O: the client is :mod:`llmgw_runtime.ctl_client`.

Every verb has one request and one reply message, encoded with :mod:`llmgw_common.codec`. An error
reply carries the NATS micro service error headers (``ERROR_HEADER``, ``ERROR_CODE_HEADER``). A reply
larger than the server's max_payload arrives in numbered parts (:mod:`llmgw_common.chunks`).

Idle times follow ARCHITECTURE #1: ``idle_s`` is negative when unknown, and ``idle_kind`` says whether a
number is exact or only a lower bound.
"""

from __future__ import annotations

from enum import StrEnum

from llmgw_common.catalog import Catalog
from llmgw_common.messages import ClusterSettings, Marks, Message, ShardState

ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
# The server's answer to a request nobody subscribes to (nats-py's request() checks the same).
STATUS_HEADER = "Status"
NO_RESPONDERS = "503"

# Verb -> subject suffix. Endpoint names (micro: letters, digits, - and _) are the verb with . -> _.
VERBS = (
    "nodes",
    "replicas",
    "models",
    "status",
    "explain-placement",
    "catalog.apply",
    "catalog.diff",
    "catalog.show",
    "cordon",
    "uncordon",
    "drain",
    "settings.get",
    "settings.set",
    "debug.stats",
)


def endpoint_name(verb: str) -> str:
    return verb.replace(".", "_")


# ---------------------------------------------------------------- requests


class Empty(Message):
    pass


class ReplicasRequest(Message):
    model: str | None = None


class ModelRequest(Message):
    model: str


class CatalogRequest(Message):
    # The catalog as YAML text, exactly as the operator wrote it.
    yaml: str


class NodeRequest(Message):
    node: str


class DrainRequest(Message):
    node: str
    # None: the control plane's default drain grace.
    grace_s: float | None = None


class SettingsSetRequest(Message):
    settings: ClusterSettings


# ---------------------------------------------------------------- replies


class NodeInfo(Message):
    name: str
    # ready, unreachable, lost; "waiting" when it heartbeats but has sent no inventory yet.
    state: str
    address: str = ""
    fabric: str | None = None
    labels: dict[str, str] = {}
    engines: tuple[str, ...] = ()
    gpu_summary: str = ""  # e.g. "8xH100-80GB"
    # Every card in exactly one of used, free, held, unhealthy (the same count as `status`'s capacity):
    # held is healthy and idle on a node that takes no new replica (cordoned, draining, unreachable, lost).
    gpus_total: int = 0
    gpus_used: int = 0
    gpus_free: int = 0
    gpus_held: int = 0
    gpus_unhealthy: int = 0
    unhealthy_reasons: tuple[str, ...] = ()
    # None: not reported (shown as "-"), never 0.
    memory_gb: float | None = None
    cpus: int | None = None
    cordoned: bool = False
    draining: bool = False
    drain_deadline: float | None = None
    last_seen_s: float | None = None
    boot_id: str = ""
    replicas: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    storage_looked: bool = False
    # The agent simulates its GPUs (fleet file, sim mode): its capacity is not real.
    simulated: bool = False


class ReplicaPhase(StrEnum):
    """A replica's phase as the control plane judges it (``llmgw_controlplane.scheduler.phase.replica_status``)."""

    STARTING = "starting"
    READY = "ready"
    # A shard failed, or it was not ready within its startup timeout.
    FAILED = "failed"
    STOPPING = "stopping"


class ModelState(StrEnum):
    """A catalog model's state in ``ctl models`` and ``ctl status``."""

    OK = "ok"
    # Some but not all of its replicas ready.
    DEGRADED = "degraded"
    # None ready, and:
    UNPLACEABLE = "unplaceable"
    BACKOFF = "backoff"
    STARTING = "starting"
    DOWN = "down"
    # The catalog asks for 0 replicas.
    OFF = "off"


class ShardInfo(Message):
    shard: int
    node: str
    gpus: tuple[int, ...] = ()
    port: int = 0
    # None: the node has not reported this shard yet.
    state: ShardState | None = None
    error: str | None = None
    log_tail: tuple[str, ...] = ()


class ReplicaInfo(Message):
    id: str
    model: str
    state: ReplicaPhase
    created: float
    shards: tuple[ShardInfo, ...] = ()
    endpoint: str | None = None
    draining: bool = False
    # Negative: unknown (no router has seen it used and none can bound it).
    idle_s: float = -1.0
    idle_kind: str = "unknown"  # unknown, exact, at_least
    idle: str = "-"
    # The routers' circuit breaker for it: closed, half_open or open (the worst across routers).
    breaker: str = "closed"
    # Why it failed (every failed shard's error, or the startup timeout); None while it has not.
    error: str | None = None
    # When the control plane stopped it as failed; None for a replica that still exists.
    failed_at: float | None = None
    # Started with an older profile of its model: it is being replaced, one replica at a time.
    outdated: bool = False
    # LoRA adapters (issue 33), as its node last reported them: loaded, and adapter -> why its last
    # load failed (shown by `ctl replicas --failed`).
    adapters: tuple[str, ...] = ()
    adapter_errors: dict[str, str] = {}


class LoadScaleInfo(Message):
    """A model whose replica count follows its load (issue 21): the target, what was measured, the count
    it asks for and why, or what holds it."""

    model: str
    target: str  # "waiting_per_replica 2"
    measured: str  # "4.5 waiting per replica", or "unknown: ..."
    # The figure in the target's unit; negative when not known (ARCHITECTURE #1: never 0 for unknown).
    value: float = -1.0
    trend: str = "unknown"  # over, under, steady, unknown
    for_s: float = 0.0  # how long the figure has been on this side of the target
    replicas: int = 0  # wanted before the last pass
    wants: int = 0  # wanted after it
    why: str = ""


class ModelCacheInfo(Message):
    """How a model's requests find cached prefixes (issue 32), merged over the routers reporting."""

    mode: str
    routers: int = 0
    # Share of prompt tokens the routers expected cached where they sent them, and the share the
    # engines report they found cached (their own counters); None without traffic.
    predicted_hit_rate: float | None = None
    engine_hit_rate: float | None = None
    # The largest index a router holds for the model, and the oldest event lag among them.
    index_blocks: int = 0
    event_lag_ms: float | None = None


class ModelInfo(Message):
    name: str
    engine: str
    gpu_class: str | None = None
    gpus_per_node: int = 0
    nodes: int = 1
    desired: int = 0
    ready: int = 0
    starting: int = 0
    failed: int = 0
    state: ModelState = ModelState.DOWN
    reason: str | None = None
    watched: bool = False
    # Its most recent failed replica (shards, errors, log tails), kept for a while after it was stopped.
    last_failure: ReplicaInfo | None = None
    # Replicas still running an older profile (a profile change being rolled out).
    outdated: int = 0
    # Set for a model that follows its load (issue 21).
    scaling: LoadScaleInfo | None = None
    # Routing by cached prefix, where a router reports it (issue 32).
    cache: ModelCacheInfo | None = None


class AdapterInfo(Message):
    """A LoRA adapter (issue 33): where it is loaded, and how often it was loaded and let go."""

    name: str
    base: str
    weights: str = ""
    rank: int | None = None
    # loaded (on a replica that serves), loading (asked, not reported loaded yet), waiting (wanted,
    # asked of no replica: ``reason``), failed (its load failed on every replica: ``reason``), idle.
    state: str = "idle"
    reason: str | None = None
    # Replicas whose node reports it loaded, and replicas whose assignment asks for it.
    loaded_on: tuple[str, ...] = ()
    assigned_to: tuple[str, ...] = ()
    # Loads and unloads asked since this control plane leads.
    loads: int = 0
    unloads: int = 0
    # Requests the routers hold, queue or have in flight for it.
    requests: int = 0
    # Replica id -> why its load failed there.
    errors: dict[str, str] = {}


class NodesReply(Message):
    nodes: tuple[NodeInfo, ...] = ()


class ReplicasReply(Message):
    replicas: tuple[ReplicaInfo, ...] = ()
    # Replicas stopped because they failed, newest first, kept for a bounded time and number.
    failed: tuple[ReplicaInfo, ...] = ()


class ModelsReply(Message):
    models: tuple[ModelInfo, ...] = ()
    adapters: tuple[AdapterInfo, ...] = ()


class ClassCapacity(Message):
    gpu_class: str
    total: int = 0
    used: int = 0
    free: int = 0
    unhealthy: int = 0
    # Healthy idle cards on nodes that take no new replica (cordoned, draining, unreachable, lost): not
    # free, not used. total = used + free + unhealthy + held = the sums of the nodes table's figures.
    held: int = 0


class UnplaceableInfo(Message):
    model: str
    reason: str
    since: float | None = None


class EvictionInfo(Message):
    """A replica stopped to make room for another model (issue 13)."""

    at: float
    replica_id: str
    model: str
    for_model: str
    nodes: tuple[str, ...] = ()
    reason: str = ""


class StatusReply(Message):
    leader: bool = True
    fence: int = 0
    catalog_version: int = 0
    capacity: tuple[ClassCapacity, ...] = ()
    # fabric -> nodes with every healthy GPU free (room for multi-node replicas).
    free_nodes_per_fabric: dict[str, int] = {}
    nodes_by_state: dict[str, int] = {}
    replicas_by_state: dict[str, int] = {}
    models_by_state: dict[str, int] = {}
    unplaceable: tuple[UnplaceableInfo, ...] = ()
    idle_replicas: tuple[str, ...] = ()
    idle_threshold_s: float = 0.0
    # fabric ("-" for nodes without one) -> weight names found there.
    weights_per_fabric: dict[str, tuple[str, ...]] = {}
    # Nodes whose agent simulates its GPUs: the capacity above counts their cards, which are not real.
    simulated_nodes: int = 0
    warnings: tuple[str, ...] = ()
    # Scaling (issue 13): models scaled to zero; wakes not yet served (model -> what is being done);
    # each model's last cold start (wake to ready, seconds); the latest evictions, oldest first.
    cold: tuple[str, ...] = ()
    waking: dict[str, str] = {}
    cold_starts: dict[str, float] = {}
    evictions: tuple[EvictionInfo, ...] = ()
    # Models that follow their load (issue 21), by name.
    scaling: tuple[LoadScaleInfo, ...] = ()


class NodeVerdict(Message):
    node: str
    ok: bool
    reasons: tuple[str, ...] = ()


class ExplainReply(Message):
    model: str
    placeable: bool
    summary: str
    # Where the next replica would go: one line per shard.
    placement: tuple[str, ...] = ()
    nodes: tuple[NodeVerdict, ...] = ()
    # When it does not fit: what would be evicted to make room and why, or why nothing would.
    eviction: str = ""
    # A load-following model (issue 21): the count it asks for and why, so the next replica's placement
    # above reads as the step's (or what stops it); empty for any other model.
    scaling: str = ""


class FieldChange(Message):
    field: str
    old: str
    new: str


class ModelChange(Message):
    name: str
    changes: tuple[FieldChange, ...] = ()


class CatalogDiff(Message):
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[ModelChange, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)


class CatalogApplyReply(Message):
    version: int
    diff: CatalogDiff


class CatalogShowReply(Message):
    version: int
    catalog: Catalog
    yaml: str


class MarksReply(Message):
    node: str
    marks: Marks


class SettingsReply(Message):
    settings: ClusterSettings


class DebugStatsReply(Message):
    leader: bool = False
    fence: int = 0
    started_at: float = 0.0
    passes: int = 0
    # Passes that raised (a bug on some input), counted since start.
    failed_passes: int = 0
    last_pass_ms: float = 0.0
    pass_p50_ms: float = 0.0
    pass_p95_ms: float = 0.0
    pass_max_ms: float = 0.0
    # The last passes' durations, oldest first (a benchmark takes those of its own window).
    recent_pass_ms: tuple[float, ...] = ()
    # Time spent in the pure reconcile() alone, last pass.
    last_reconcile_ms: float = 0.0
    heartbeats: int = 0
    heartbeats_per_s: float = 0.0
    dropped: int = 0
    nodes: int = 0
    replicas: int = 0
    desired_replicas: int = 0
    placed_replicas: int = 0
    ready_replicas: int = 0
    unplaceable_models: int = 0
    assignment_writes: int = 0
    rss_mb: float | None = None


class LeaseRecord(Message):
    """The value of ``<prefix>_leader`` key ``leader``: who leads. The key's revision is the fence."""

    holder: str
    acquired_at: float
    renewed_at: float
