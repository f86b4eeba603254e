"""The ctl replies, built from a snapshot and the control plane's tables. Pure: no bus, no clock.

Distinctions kept here: unhealthy GPUs are neither used nor free (#2); a node that did not report
memory shows ``None`` (#3); an idle time nobody knows is negative in JSON and ``-`` in tables (#1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from pydantic import BaseModel

from llmgw_common.catalog import Catalog
from llmgw_common.ctl import (
    CatalogDiff,
    ClassCapacity,
    ExplainReply,
    FieldChange,
    ModelChange,
    ModelInfo,
    ModelState,
    NodeInfo,
    NodeVerdict,
    ReplicaInfo,
    ShardInfo,
    StatusReply,
    UnplaceableInfo,
)
from llmgw_common.messages import ClusterSettings
from llmgw_controlplane.nodes import NodeRecord
from llmgw_controlplane.scheduler.idle import IdleMerger
from llmgw_controlplane.scheduler.phase import ReplicaPhase, replica_phase, serving
from llmgw_controlplane.scheduler.placement import Explanation, Placement
from llmgw_controlplane.scheduler.routing import endpoint_url
from llmgw_controlplane.scheduler.snapshot import GpuView, NodeState, NodeView, ReplicaView, Snapshot
from llmgw_controlplane.state import ClusterState

USED, FREE, HELD, UNHEALTHY = "used", "free", "held", "unhealthy"


def gpu_buckets(n: NodeView, used: set[int]) -> list[tuple[GpuView, str]]:
    """Each card of ``n`` in exactly one bucket: the one count behind `ctl nodes` and `ctl status`.

    Unhealthy cards are neither used nor free (#2). A healthy idle card is free only on a node that
    takes new replicas; on a cordoned, draining, unreachable or lost node it is held: not room.
    """
    placeable = n.state is NodeState.READY and not n.cordoned and not n.draining
    out = []
    for g in n.gpus:
        if not g.healthy:
            out.append((g, UNHEALTHY))
        elif g.index in used:
            out.append((g, USED))
        else:
            out.append((g, FREE if placeable else HELD))
    return out


def simulated_text(count: int) -> str:
    return f"{count} simulated node{'s' if count != 1 else ''}: capacity shown is not real"


def _gpu_summary(classes: Counter[str]) -> str:
    return ", ".join(f"{n}x{c}" for c, n in sorted(classes.items()))


def node_state_text(state: ClusterState, rec: NodeRecord, now: float) -> str:
    """The node's state as the tables show it; `status` counts the same words, so they cannot disagree."""
    health = state.health(rec, now)
    if health is NodeState.READY and not rec.heard:
        return "not heard"
    if health is NodeState.READY and rec.inventory is None:
        return "waiting"
    return str(health)


def nodes_info(state: ClusterState, snap: Snapshot) -> tuple[NodeInfo, ...]:
    used = snap.used_gpus()
    on_node: dict[str, list[str]] = {}
    for r in snap.replicas:
        for s in r.shards:
            on_node.setdefault(s.node, []).append(r.id)
    out = []
    for name in sorted(state.nodes):
        rec = state.nodes[name]
        view = snap.nodes.get(name)
        inv = rec.inventory
        st = node_state_text(state, rec, snap.now)
        gpus = inv.gpus if inv is not None else ()
        counts = Counter(b for _, b in gpu_buckets(view, used.get(name, set()))) if view else Counter()
        unhealthy = [g for g in gpus if not g.healthy]
        deadline = state.marks.draining.get(name)
        out.append(
            NodeInfo(
                name=name,
                state=st,
                address=rec.address,
                fabric=inv.fabric if inv else None,
                labels=dict(inv.labels) if inv else {},
                engines=tuple(inv.engines) if inv else (),
                gpu_summary=_gpu_summary(Counter(g.gpu_class for g in gpus)),
                gpus_total=len(gpus),
                gpus_used=counts[USED],
                gpus_free=counts[FREE],
                gpus_held=counts[HELD],
                gpus_unhealthy=counts[UNHEALTHY],
                unhealthy_reasons=tuple(
                    f"GPU {g.index}: {', '.join(g.reasons) or 'unhealthy'}" for g in unhealthy
                ),
                memory_gb=inv.memory_gb if inv else None,
                cpus=inv.cpus if inv else None,
                cordoned=view.cordoned if view else name in state.marks.cordoned,
                draining=deadline is not None,
                drain_deadline=deadline,
                last_seen_s=round(snap.now - rec.last_seen, 3) if rec.heard else None,
                boot_id=rec.boot_id,
                replicas=tuple(sorted(on_node.get(name, ()))),
                weights=tuple(sorted({w.name for w in inv.storage.weights})) if inv else (),
                storage_looked=inv.storage.looked if inv else False,
                simulated=inv.simulated if inv else False,
            )
        )
    return tuple(out)


def shard_infos(state: ClusterState, r: ReplicaView) -> tuple[ShardInfo, ...]:
    """Each shard as last reported, with the error and engine log tail of its status messages."""
    out = []
    for s in r.shards:
        d = state.detail(s.node, (r.id, s.shard))
        out.append(
            ShardInfo(
                shard=s.shard,
                node=s.node,
                gpus=s.gpus,
                port=s.port,
                state=s.state,
                error=(d.error if d is not None and d.error else s.error),
                log_tail=d.log_tail if d is not None else (),
            )
        )
    return tuple(out)


def replicas_info(
    state: ClusterState, snap: Snapshot, idle: IdleMerger, model: str | None = None
) -> tuple[ReplicaInfo, ...]:
    out = []
    for r in snap.replicas:
        if model is not None and r.model != model:
            continue
        rec = state.replicas.get(r.id)
        created = rec.created if rec is not None else r.created
        shards = shard_infos(state, r)
        errors = [f"shard {s.shard} on {s.node}: {s.error}" for s in shards if s.error]
        k = idle.idle_for(r.id, snap.now, created)
        out.append(
            ReplicaInfo(
                id=r.id,
                model=r.model,
                state=replica_phase(snap, r),
                created=created,
                shards=shards,
                endpoint=endpoint_url(snap, r) if serving(snap, r) else None,
                draining=r.draining,
                idle_s=k.json_seconds(),
                idle_kind=str(k.kind),
                idle=k.text(),
                breaker=idle.breaker(r.id),
                error="; ".join(errors) or None,
                outdated=r.spec is not None
                and (p := snap.catalog.get(r.model)) is not None
                and not r.spec.matches(p),
            )
        )
    return tuple(out)


def models_info(
    snap: Snapshot, reasons: Mapping[str, str], unplaceable: Mapping[str, str], backoff: Mapping[str, str]
) -> tuple[ModelInfo, ...]:
    out = []
    for p in snap.catalog.models:
        reps = snap.replicas_of(p.name)
        phases = Counter(replica_phase(snap, r) for r in reps)
        ready = sum(1 for r in reps if serving(snap, r))
        if p.replicas == 0:
            st = ModelState.OFF
        elif ready >= p.replicas:
            st = ModelState.OK
        elif ready > 0:
            st = ModelState.DEGRADED
        elif p.name in unplaceable:
            st = ModelState.UNPLACEABLE
        elif p.name in backoff:
            st = ModelState.BACKOFF
        elif phases[ReplicaPhase.STARTING]:
            st = ModelState.STARTING
        else:
            st = ModelState.DOWN
        reason = None
        if st is not ModelState.OK:
            reason = unplaceable.get(p.name) or backoff.get(p.name) or reasons.get(p.name)
        outdated = sum(1 for r in reps if r.spec is not None and not r.spec.matches(p))
        if outdated and st is ModelState.OK:
            # Serving, but a profile change is still being rolled out (one replica at a time).
            reason = f"rolling out a profile change: {outdated} replica(s) on the old profile"
            if p.name in unplaceable or p.name in backoff:
                reason += f"; replacement held up: {unplaceable.get(p.name) or backoff.get(p.name)}"
        out.append(
            ModelInfo(
                name=p.name,
                engine=p.engine,
                gpu_class=p.gpu_class,
                gpus_per_node=p.gpus,
                nodes=p.nodes,
                desired=p.replicas,
                ready=ready,
                starting=phases[ReplicaPhase.STARTING],
                failed=phases[ReplicaPhase.FAILED],
                state=st,
                reason=reason,
                watched=p.watch is not None,
                outdated=outdated,
            )
        )
    return tuple(out)


def status_info(
    state: ClusterState,
    snap: Snapshot,
    idle: IdleMerger,
    *,
    models: tuple[ModelInfo, ...],
    unplaceable: Mapping[str, str],
    unplaceable_since: Mapping[str, float],
    settings: ClusterSettings,
    idle_threshold_s: float,
    leader: bool,
    fence: int,
    catalog_version: int,
) -> StatusReply:
    used = snap.used_gpus()
    cap: dict[str, Counter[str]] = {}
    free_nodes: Counter[str] = Counter()
    weights: dict[str, set[str]] = {}
    for name, n in snap.nodes.items():
        buckets = gpu_buckets(n, used.get(name, set()))
        for g, b in buckets:
            c = cap.setdefault(g.gpu_class, Counter())
            c["total"] += 1
            c[b] += 1
        healthy = sum(1 for _, b in buckets if b != UNHEALTHY)
        if healthy and all(b in (FREE, UNHEALTHY) for _, b in buckets):
            free_nodes[n.fabric or "-"] += 1
        for w in n.weights:
            weights.setdefault(n.fabric or "-", set()).add(w.name)
    nodes_by_state = Counter(node_state_text(state, rec, snap.now) for rec in state.nodes.values())
    replicas_by_state = Counter(replica_phase(snap, r) for r in snap.replicas)
    idle_reps = tuple(
        r.id
        for r in snap.replicas
        if idle.idle_for(
            r.id, snap.now, state.replicas[r.id].created if r.id in state.replicas else r.created
        ).at_least(idle_threshold_s)
    )
    warnings = []
    simulated = sum(
        1 for rec in state.nodes.values() if rec.inventory is not None and rec.inventory.simulated
    )
    if simulated:
        warnings.append(simulated_text(simulated))
    if not settings.webhooks:
        warnings.append(
            "no webhook configured: node-lost and model-down events reach nobody (add one with `llmgw setup --webhook URL`)"
        )
    if any(m.state in ("down", "unplaceable", "backoff") for m in models):
        down = [m.name for m in models if m.state in ("down", "unplaceable", "backoff")]
        warnings.append(f"{len(down)} model(s) without a ready replica: {', '.join(down[:5])}")
    return StatusReply(
        leader=leader,
        fence=fence,
        catalog_version=catalog_version,
        capacity=tuple(
            ClassCapacity(
                gpu_class=k,
                total=v["total"],
                used=v["used"],
                free=v["free"],
                unhealthy=v["unhealthy"],
                held=v["held"],
            )
            for k, v in sorted(cap.items())
        ),
        free_nodes_per_fabric=dict(sorted(free_nodes.items())),
        nodes_by_state=dict(nodes_by_state),
        replicas_by_state=dict(replicas_by_state),
        models_by_state=dict(Counter(m.state for m in models)),
        unplaceable=tuple(
            UnplaceableInfo(model=m, reason=r, since=unplaceable_since.get(m))
            for m, r in sorted(unplaceable.items())
        ),
        idle_replicas=idle_reps,
        idle_threshold_s=idle_threshold_s,
        weights_per_fabric={k: tuple(sorted(v)) for k, v in sorted(weights.items())},
        simulated_nodes=simulated,
        warnings=tuple(warnings),
    )


def explain_info(ex: Explanation) -> ExplainReply:
    nodes = []
    for v in sorted(ex.nodes, key=lambda v: (not v.feasible, v.rank or 0, v.node)):
        if v.feasible:
            reasons = (f"fits (rank {v.rank})",) if v.rank is not None else ("fits",)
        else:
            reasons = (v.reason or "refused",)
        nodes.append(NodeVerdict(node=v.node, ok=v.feasible, reasons=reasons))
    for f in ex.fabrics:
        if not f.feasible:
            nodes.append(
                NodeVerdict(node=f"fabric {f.fabric}", ok=False, reasons=(f.reason or "too few nodes",))
            )
    nxt = ex.next
    if isinstance(nxt, Placement):
        placement = tuple(
            f"shard {i} -> {s.node} GPUs {list(s.gpus) if s.gpus else 'none (CPU)'}"
            for i, s in enumerate(nxt.shards)
        ) + tuple(f"why: {r}" for r in nxt.reasons)
        summary = f"the next replica of {ex.model} ({ex.needs}) would go to {', '.join(nxt.nodes)}"
        return ExplainReply(
            model=ex.model, placeable=True, summary=summary, placement=placement, nodes=tuple(nodes)
        )
    return ExplainReply(
        model=ex.model, placeable=False, summary=f"needs {ex.needs}: {nxt.summary}", nodes=tuple(nodes)
    )


def catalog_diff(old: Catalog, new: Catalog) -> CatalogDiff:
    # LoRA adapters (issue 33) are listed beside the models, named as such: adding one restarts nothing.
    before: dict[str, BaseModel] = {m.name: m for m in old.models}
    before.update({f"adapter {a.name}": a for a in old.adapters})
    after: dict[str, BaseModel] = {m.name: m for m in new.models}
    after.update({f"adapter {a.name}": a for a in new.adapters})
    changed = []
    for name in sorted(set(before) & set(after)):
        a = before[name].model_dump(mode="json")
        b = after[name].model_dump(mode="json")
        fields = [
            FieldChange(field=k, old=_show(a.get(k)), new=_show(b.get(k)))
            for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)
        ]
        if fields:
            changed.append(ModelChange(name=name, changes=tuple(fields)))
    return CatalogDiff(
        added=tuple(sorted(set(after) - set(before))),
        removed=tuple(sorted(set(before) - set(after))),
        changed=tuple(changed),
    )


def _show(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, list | tuple) and not v:
        return "[]"
    return str(v)
