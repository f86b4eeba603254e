"""What routers are told: the ready endpoints per model, and for the rest why not, in the user's terms.

Pure: a snapshot plus the reconciler's reasons in, the content of ``RoutingEndpoints`` out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from llmgw_common.durations import format_duration
from llmgw_common.messages import Endpoint, ShardState
from llmgw_common.names import clipped
from llmgw_controlplane.scheduler.phase import ReplicaPhase, replica_status, serving
from llmgw_controlplane.scheduler.snapshot import NodeState, ReplicaView, Snapshot

# The most of one model's "why not" that routers (and events) are given.
REASON_CHARS = 2000
_ON_LOST = "on a lost node"
# On its way, in the takeover table, for a model nothing is placed for yet: the first pass places it.
FIRST_PLACEMENT = "its first replica (placed by the new leader's first pass)"


def endpoint_url(snap: Snapshot, r: ReplicaView) -> str | None:
    s0 = min(r.shards, key=lambda s: s.shard, default=None)
    if s0 is None or not s0.port:
        return None
    node = snap.nodes.get(s0.node)
    address = node.address if node is not None else "127.0.0.1"
    return f"http://{address}:{s0.port}"


def _not_ready_summary(snap: Snapshot, reps: tuple[ReplicaView, ...]) -> str:
    counts: Counter[tuple[str, str]] = Counter()
    first_error: dict[str, str] = {}
    for r in reps:
        lost = [
            s.node for s in r.shards if (n := snap.nodes.get(s.node)) is None or n.state is NodeState.LOST
        ]
        if lost:
            counts[(_ON_LOST, lost[0])] += 1
            continue
        st = replica_status(snap, r)
        phase = str(st.phase)
        counts[(phase, r.shards[0].node if r.shards else "?")] += 1
        if st.phase is ReplicaPhase.FAILED and phase not in first_error:
            # A shard's own words when it failed; the startup timeout's when none did.
            shard_failed = [s for s in r.shards if s.state is ShardState.FAILED]
            err = next((s.error for s in shard_failed if s.error), None) if shard_failed else st.errors[0]
            if err:
                first_error[phase] = err
    parts = []
    for (phase, node), count in sorted(counts.items()):
        text = f"{count} {phase} on {node}" if phase != _ON_LOST else f"{count} on lost node {node}"
        if phase in first_error:
            text += f" ({first_error.pop(phase)})"
        parts.append(text)
    return "no ready replica: " + ", ".join(parts)


def _flag_replaced(eps: list[tuple[ReplicaView, Endpoint]], wanted: int) -> tuple[Endpoint, ...]:
    """Flag ``draining`` only the draining replicas that enough replacements already stand in for (#8).

    A draining replica keeps taking new requests while its model has fewer non-draining replicas serving
    than it wants: flagging it as soon as it is marked would serve the model one replica short for the
    whole of every roll or drain step. The ones kept are the oldest, as the reconciler keeps them (it
    stops the others). A model is never left with only flagged endpoints: that would refuse every request
    while the stop is still on its way.
    """
    undrained = sum(1 for r, _ in eps if not r.draining)
    keep = max(wanted - undrained, 1 if undrained == 0 else 0)
    kept = {r.id for r in sorted((r for r, _ in eps if r.draining), key=lambda r: (r.created, r.id))[:keep]}
    return tuple(
        e.model_copy(update={"draining": True}) if r.draining and r.id not in kept else e for r, e in eps
    )


def routing_content(
    snap: Snapshot, reasons: Mapping[str, str], wanted: Mapping[str, int] | None = None
) -> tuple[dict[str, tuple[Endpoint, ...]], dict[str, str]]:
    """(endpoints per model, why-unavailable per model) for the catalog's models.

    ``reasons`` are the reconciler's words for models it could not place or holds in backoff; they win
    over the generic "no ready replica" summary when nothing is ready. ``wanted``: scaling's counts
    (a model scaled down flags its draining replica once the others are enough for that count).
    """
    endpoints: dict[str, tuple[Endpoint, ...]] = {}
    unavailable: dict[str, str] = {}
    by_model: dict[str, list[ReplicaView]] = {}
    for r in snap.replicas:
        by_model.setdefault(r.model, []).append(r)
    for profile in snap.catalog.models:
        reps = tuple(by_model.get(profile.name, ()))
        eps = []
        for r in reps:
            if not serving(snap, r):
                continue
            url = endpoint_url(snap, r)
            if url is None:
                continue
            eps.append(
                (r, Endpoint(replica_id=r.id, model=r.model, url=url, node=r.shards[0].node, draining=False))
            )
        if eps:
            count = profile.replicas if wanted is None else wanted.get(profile.name, profile.replicas)
            endpoints[profile.name] = _flag_replaced(eps, count)
            continue
        if profile.replicas == 0:
            unavailable[profile.name] = "the catalog asks for 0 replicas of this model"
        elif profile.name in reasons:
            unavailable[profile.name] = reasons[profile.name]
        elif not reps:
            unavailable[profile.name] = "no replica placed yet"
        else:
            unavailable[profile.name] = _not_ready_summary(snap, reps)
    # Every model's text goes into one KV value (and into events): each is bounded.
    return endpoints, {m: clipped(text, REASON_CHARS) for m, text in unavailable.items()}


def coming_content(
    snap: Snapshot,
    endpoints: Mapping[str, tuple[Endpoint, ...]],
    waking: Mapping[str, str],
    cold: Iterable[str],
) -> tuple[dict[str, str], tuple[str, ...]]:
    """(model -> what is on its way, models scaled to zero) for catalog models without a ready endpoint.

    On its way: a replica placed or starting (a first start, a replacement, a wake) on a node not lost,
    or a wake being served (room being made). Routers hold requests for these instead of refusing.
    Cold: scaled to zero by idleness with nothing on its way; a request for one wakes it.
    """
    starting: dict[str, list[str]] = {}
    for r in snap.replicas:
        if r.model in endpoints or r.draining or replica_status(snap, r).phase is not ReplicaPhase.STARTING:
            continue
        if any((n := snap.nodes.get(s.node)) is None or n.state is NodeState.LOST for s in r.shards):
            continue
        starting.setdefault(r.model, []).append(r.shards[0].node if r.shards else "?")
    coming: dict[str, str] = {}
    for profile in snap.catalog.models:
        name = profile.name
        if name in endpoints:
            continue
        nodes = starting.get(name)
        if nodes:
            where = ", ".join(sorted(set(nodes)))
            coming[name] = f"{len(nodes)} replica{'s' if len(nodes) > 1 else ''} starting on {where}"
        elif name in waking:
            coming[name] = clipped(waking[name], REASON_CHARS)
    catalog = set(snap.catalog.names)
    return coming, tuple(sorted(m for m in cold if m in catalog and m not in endpoints and m not in coming))


def takeover_content(
    snap: Snapshot, cold_before: Iterable[str]
) -> tuple[dict[str, tuple[Endpoint, ...]], dict[str, str], dict[str, str], tuple[str, ...]]:
    """The routing table a control plane writes the moment it takes over, before its first pass.

    The table in KV is the previous writer's (another process, or this one's previous run, whose engines
    may be gone with it): routers must not keep sending requests to what nothing has confirmed since this
    start. Judged by :func:`serving` from ``snap``, which knows shard states only from reports this
    process received, so a replica its node's agent has not reported yet is not routed but on its way
    (routers hold requests for it). ``cold_before``: the previous table's models scaled to zero, kept
    while nothing of theirs runs (a request for one still wakes it).
    """
    endpoints, unavailable = routing_content(snap, {})
    coming, cold = coming_content(snap, endpoints, {}, cold_before)
    placed = {r.model for r in snap.replicas}
    cold = tuple(m for m in cold if m not in placed)
    for m in cold:
        p = snap.catalog.get(m)
        unavailable[m] = cold_reason(p.idle_after if p is not None else None)
    # Nothing placed yet (a new cluster, a catalog applied while none led): the first pass, once settled,
    # places it, so routers hold its requests for those seconds rather than refuse them. If that pass
    # cannot place it, its table takes the model off the way with the reconciler's reason, and routers
    # refuse the held requests with it. A model that starts cold (floor 0) waits for a wake instead.
    for p in snap.catalog.models:
        if p.replicas > 0 and p.floor > 0 and p.name not in placed and p.name not in cold:
            coming[p.name] = FIRST_PLACEMENT
    return endpoints, unavailable, coming, cold


def cold_reason(idle_after: float | None) -> str:
    """The 503 text for a model scaled to zero, for routers that do not wake models."""
    after = "" if idle_after is None else f" after {format_duration(idle_after)} unused"
    return f"scaled to zero{after}: a request wakes it"
