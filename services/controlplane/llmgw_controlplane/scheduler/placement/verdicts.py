"""Every node's verdict for a profile (its reason, or its score and rank), every fabric's, and the one-line
summary of a refusal: what ``Unplaceable`` and ``ctl explain-placement`` say."""

from __future__ import annotations

from collections.abc import Iterable

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.placement.feasibility import (
    NO_FABRIC,
    fabric_short,
    gpu_shortage,
    no_fabric,
    profile_problem,
    shape,
)
from llmgw_controlplane.scheduler.placement.fleet import Fleet
from llmgw_controlplane.scheduler.placement.ranking import Ranker
from llmgw_controlplane.scheduler.placement.score import NodeScore
from llmgw_controlplane.scheduler.placement.types import (
    FabricRejection,
    FabricVerdict,
    NodeRejection,
    NodeVerdict,
    Stage,
    Unplaceable,
)

_SUMMARY_GROUPS = 4
_NAMES_SHOWN = 3


def verdicts(
    profile: ModelProfile, fleet: Fleet, exclude: frozenset[str]
) -> tuple[list[NodeVerdict], list[FabricVerdict]]:
    """Every node's verdict and every fabric's (multi-node), as the filters see them."""
    ok, rejected = fleet.static(profile, exclude)
    out: list[NodeVerdict] = [
        NodeVerdict(r.node, fleet.node(r.node).fabric, False, r.reason, r.stage) for r in rejected
    ]
    cls = profile.gpu_class
    need = profile.gpus
    ranker = Ranker(fleet, profile)
    passing: list[tuple[str, NodeScore]] = []
    for name in ok:
        fabric = fleet.node(name).fabric
        free: int | None = None
        if cls is not None:
            free = len(fleet.free(name, cls))
            if free < need:
                why = gpu_shortage(fleet.node(name), fleet.used(name), cls, free, need)
                out.append(NodeVerdict(name, fabric, False, why, Stage.GPUS))
                continue
        passing.append((name, ranker.score(name, free)))
    fabrics: list[FabricVerdict] = []
    if profile.nodes > 1:
        by_fabric: dict[str, list[str]] = {}
        for name, _ in passing:
            f = fleet.node(name).fabric
            if f is not None:
                by_fabric.setdefault(f, []).append(name)
        all_fabrics = sorted({n.fabric for n in fleet.snap.nodes.values() if n.fabric is not None})
        for f in all_fabrics:
            names = tuple(by_fabric.get(f, ()))
            if len(names) >= profile.nodes:
                fabrics.append(FabricVerdict(f, names, profile.nodes, True))
            else:
                fabrics.append(
                    FabricVerdict(f, names, profile.nodes, False, fabric_short(profile, f, len(names)))
                )
        short = {fv.fabric: fv.reason for fv in fabrics if not fv.feasible}
        kept: list[tuple[str, NodeScore]] = []
        for name, score in passing:
            f = fleet.node(name).fabric
            if f is None:
                out.append(NodeVerdict(name, None, False, no_fabric(profile), Stage.FABRIC))
            elif f in short:
                out.append(NodeVerdict(name, f, False, short[f], Stage.FABRIC))
            else:
                kept.append((name, score))
        passing = kept
    passing.sort(key=lambda p: p[1].key(p[0]))
    for i, (name, score) in enumerate(passing, start=1):
        out.append(NodeVerdict(name, fleet.node(name).fabric, True, score=score, rank=i))
    out.sort(key=lambda v: v.node)
    return out, fabrics


def _name_list(names: list[str]) -> str:
    if len(names) <= _NAMES_SHOWN:
        return ", ".join(names)
    return f"{', '.join(names[:_NAMES_SHOWN])} and {len(names) - _NAMES_SHOWN} more"


def summarize(
    model: str,
    profile_nodes: int,
    rejections: Iterable[NodeRejection],
    fabrics: Iterable[FabricRejection] = (),
) -> str:
    """One line: the closest misses first, identical reasons grouped with their nodes counted."""
    # Fabrics that came close, closest first; those without a single eligible node are explained by
    # their nodes' own reasons.
    near = sorted((f for f in fabrics if f.eligible > 0), key=lambda f: (-f.eligible, f.fabric))
    fabric_parts = [f.reason for f in near[:_SUMMARY_GROUPS]]
    if len(near) > _SUMMARY_GROUPS:
        fabric_parts.append(f"{len(near) - _SUMMARY_GROUPS} more fabrics short of whole nodes")
    groups: dict[str, list[NodeRejection]] = {}
    for r in rejections:
        if r.stage == Stage.FABRIC and fabric_parts and not r.reason.startswith(NO_FABRIC):
            continue  # said once per fabric
        groups.setdefault(r.reason, []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (-kv[1][0].stage, -len(kv[1]), kv[0]))
    parts = list(fabric_parts)
    for reason, rs in ordered[:_SUMMARY_GROUPS]:
        names = sorted(r.node for r in rs)
        if len(names) == 1:
            parts.append(f"{names[0]} {reason}")
        else:
            parts.append(f"{len(names)} nodes ({_name_list(names)}): {reason}")
    if len(ordered) > _SUMMARY_GROUPS:
        rest = sum(len(rs) for _, rs in ordered[_SUMMARY_GROUPS:])
        parts.append(f"{rest} more nodes for other reasons")
    head = (
        f"no fabric has {profile_nodes} whole nodes for model {model}"
        if profile_nodes > 1
        else f"no node can hold model {model}"
    )
    if not parts:
        return f"{head}: no node has reported"
    return f"{head}: {'; '.join(parts)}"


def unplaceable(profile: ModelProfile, fleet: Fleet, exclude: frozenset[str]) -> Unplaceable:
    """The refusal with every node's and fabric's reason; one answer per shape and size in a pass."""
    problem = profile_problem(profile)
    if problem is not None:
        return Unplaceable(profile.name, (), problem)
    key = (shape(profile, exclude), profile.gpus, profile.nodes)
    seen = fleet.failed.get(key)
    if seen is not None:
        summary = summarize(profile.name, profile.nodes, seen.reasons, seen.fabrics)
        return Unplaceable(profile.name, seen.reasons, summary, seen.fabrics)
    node_verdicts, fabric_verdicts = verdicts(profile, fleet, exclude)
    rejections = tuple(
        NodeRejection(v.node, v.reason or "", v.stage or Stage.STATE) for v in node_verdicts if not v.feasible
    )
    frej = tuple(
        FabricRejection(f.fabric, f.reason or "", len(f.eligible_nodes))
        for f in fabric_verdicts
        if not f.feasible
    )
    out = Unplaceable(
        profile.name, rejections, summarize(profile.name, profile.nodes, rejections, frej), frej
    )
    fleet.failed[key] = out
    return out
