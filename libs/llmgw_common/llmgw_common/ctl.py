"""The management API: typed requests and replies of the ``llmgw.ctl.<verb>`` micro service, and a client.

Every verb has one request and one reply message, encoded with :mod:`llmgw_common.codec`. An error
reply carries the NATS micro service error headers; :class:`CtlClient` turns it into :class:`CtlError`
with the control plane's user-facing description, and a silent bus into :class:`CtlUnavailable`. A reply
larger than the server's max_payload arrives in numbered parts (:mod:`llmgw_common.chunks`) and is joined.

Idle times follow ARCHITECTURE #1: ``idle_s`` is negative when unknown, and ``idle_kind`` says whether a
number is exact or only a lower bound.
"""

from __future__ import annotations

import contextlib
from typing import TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from llmgw_common import chunks
from llmgw_common.catalog import Catalog
from llmgw_common.codec import MAX_PAYLOAD, DecodeError, decode, encode
from llmgw_common.errors import LlmgwError, Unavailable
from llmgw_common.messages import ClusterSettings, Marks, Message
from llmgw_common.subjects import Subjects

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


class CtlError(LlmgwError):
    """The control plane answered with an error; ``message`` is meant for the user."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class CtlUnavailable(CtlError, Unavailable):
    """No control plane answered."""


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


class ShardInfo(Message):
    shard: int
    node: str
    gpus: tuple[int, ...] = ()
    port: int = 0
    # None: the node has not reported this shard yet.
    state: str | None = None
    error: str | None = None
    log_tail: tuple[str, ...] = ()


class ReplicaInfo(Message):
    id: str
    model: str
    state: str  # starting, ready, failed, stopping
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
    # ok, degraded (some but not all ready), down (none ready), unplaceable, backoff, off (replicas: 0)
    state: str = "down"
    reason: str | None = None
    watched: bool = False
    # Its most recent failed replica (shards, errors, log tails), kept for a while after it was stopped.
    last_failure: ReplicaInfo | None = None
    # Replicas still running an older profile (a profile change being rolled out).
    outdated: int = 0


class NodesReply(Message):
    nodes: tuple[NodeInfo, ...] = ()


class ReplicasReply(Message):
    replicas: tuple[ReplicaInfo, ...] = ()
    # Replicas stopped because they failed, newest first, kept for a bounded time and number.
    failed: tuple[ReplicaInfo, ...] = ()


class ModelsReply(Message):
    models: tuple[ModelInfo, ...] = ()


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


R = TypeVar("R", bound=Message)


class CtlClient:
    """One method per ctl verb. Raises :class:`CtlError`, or :class:`CtlUnavailable` when none answers."""

    def __init__(self, nc: NATS, prefix: str = "llmgw", timeout: float = 2.0) -> None:
        self.nc = nc
        self.subjects = Subjects(prefix)
        self.timeout = timeout

    async def call(self, verb: str, request: Message, reply_cls: type[R], timeout: float | None = None) -> R:
        subject = self.subjects.ctl(verb)
        wait = self.timeout if timeout is None else timeout
        # Its own inbox rather than nc.request(): a large answer comes as several messages (chunks.py).
        sub = await self.nc.subscribe(self.nc.new_inbox())
        try:
            await self.nc.publish(subject, encode(request), reply=sub.subject)
            msg = await self._next(sub, wait, subject)
            headers = msg.headers or {}
            if headers.get(STATUS_HEADER) == NO_RESPONDERS:
                raise self._not_served(subject)
            if ERROR_HEADER in headers:
                # The body, when present, is the full (multi-line) description; the header is one line.
                text = msg.data.decode("utf-8", "replace") if msg.data else headers[ERROR_HEADER]
                raise CtlError(text, headers.get(ERROR_CODE_HEADER, ""))
            data = msg.data
            if chunks.CHUNK_HEADER in headers:
                data = await self._rest(sub, msg, wait, verb)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        try:
            return decode(data, reply_cls, limit=max(len(data), MAX_PAYLOAD))
        except DecodeError as e:
            raise CtlError(f"the control plane's reply to {verb} could not be read: {e}") from None

    async def _next(self, sub: Subscription, wait: float, subject: str) -> Msg:
        try:
            return await sub.next_msg(timeout=wait)
        except nats.errors.TimeoutError:
            raise self._unavailable(subject, wait) from None

    async def _rest(self, sub: Subscription, first: Msg, wait: float, verb: str) -> bytes:
        """The remaining chunks of a reply whose first part is ``first``, joined in order."""
        try:
            count = chunks.parse((first.headers or {})[chunks.CHUNK_HEADER], 1, None)
            parts = [first.data]
            for i in range(2, count + 1):
                try:
                    msg = await sub.next_msg(timeout=wait)
                except nats.errors.TimeoutError:
                    raise CtlError(
                        f"the control plane's reply to {verb} stopped after {i - 1} of {count} parts "
                        f"(nothing for {wait:g}s); try again"
                    ) from None
                chunks.parse((msg.headers or {}).get(chunks.CHUNK_HEADER, ""), i, count)
                parts.append(msg.data)
        except chunks.ChunkError as e:
            raise CtlError(f"the control plane's reply to {verb} could not be read: {e}") from None
        return b"".join(parts)

    @staticmethod
    def _not_served(subject: str) -> CtlUnavailable:
        # The server's immediate answer: nobody subscribes (none running, or a takeover in its gap).
        return CtlUnavailable(
            f"no control plane answered on {subject}: none is serving it (is `llmgw controlplane` "
            "running, with the same --nats and --prefix? a standby takes over within a lease TTL)"
        )

    @staticmethod
    def _unavailable(subject: str, wait: float) -> CtlUnavailable:
        return CtlUnavailable(
            f"no control plane answered on {subject} within {wait:g}s "
            "(is `llmgw controlplane` running, with the same --nats and --prefix?)"
        )

    async def nodes(self) -> NodesReply:
        return await self.call("nodes", Empty(), NodesReply)

    async def replicas(self, model: str | None = None) -> ReplicasReply:
        return await self.call("replicas", ReplicasRequest(model=model), ReplicasReply)

    async def models(self) -> ModelsReply:
        return await self.call("models", Empty(), ModelsReply)

    async def status(self) -> StatusReply:
        return await self.call("status", Empty(), StatusReply)

    async def explain_placement(self, model: str) -> ExplainReply:
        return await self.call("explain-placement", ModelRequest(model=model), ExplainReply)

    async def catalog_apply(self, yaml_text: str) -> CatalogApplyReply:
        return await self.call("catalog.apply", CatalogRequest(yaml=yaml_text), CatalogApplyReply)

    async def catalog_diff(self, yaml_text: str) -> CatalogDiff:
        return await self.call("catalog.diff", CatalogRequest(yaml=yaml_text), CatalogDiff)

    async def catalog_show(self) -> CatalogShowReply:
        return await self.call("catalog.show", Empty(), CatalogShowReply)

    async def cordon(self, node: str) -> MarksReply:
        return await self.call("cordon", NodeRequest(node=node), MarksReply)

    async def uncordon(self, node: str) -> MarksReply:
        return await self.call("uncordon", NodeRequest(node=node), MarksReply)

    async def drain(self, node: str, grace_s: float | None = None) -> MarksReply:
        return await self.call("drain", DrainRequest(node=node, grace_s=grace_s), MarksReply)

    async def settings_get(self) -> SettingsReply:
        return await self.call("settings.get", Empty(), SettingsReply)

    async def settings_set(self, settings: ClusterSettings) -> SettingsReply:
        return await self.call("settings.set", SettingsSetRequest(settings=settings), SettingsReply)

    async def debug_stats(self) -> DebugStatsReply:
        return await self.call("debug.stats", Empty(), DebugStatsReply)
