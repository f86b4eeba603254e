"""What ``ctl explain-placement`` shows: what a replica needs, every node's and fabric's verdict, and
where the next replica would go (the same decision :func:`place` makes)."""

from __future__ import annotations

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.placement.feasibility import profile_problem
from llmgw_controlplane.scheduler.placement.fleet import Fleet
from llmgw_controlplane.scheduler.placement.selection import place_in
from llmgw_controlplane.scheduler.placement.types import Explanation, Unplaceable
from llmgw_controlplane.scheduler.placement.verdicts import verdicts
from llmgw_controlplane.scheduler.snapshot import Snapshot


def needs(profile: ModelProfile) -> str:
    """What one replica needs, in words ("2 nodes x 8 H100-80GB, engine vllm")."""
    per = f"{profile.gpus} {profile.gpu_class}" if profile.gpu_class else "no GPU"
    where = f"{profile.nodes} nodes x {per}" if profile.nodes > 1 else per
    return f"{where}, engine {profile.engine}"


def explain_in(
    profile: ModelProfile, fleet: Fleet, *, exclude_nodes: frozenset[str] = frozenset()
) -> Explanation:
    """:func:`explain` over a pass's :class:`Fleet`."""
    problem = profile_problem(profile)
    if problem is not None:
        return Explanation(profile.name, needs(profile), (), (), Unplaceable(profile.name, (), problem))
    node_verdicts, fabric_verdicts = verdicts(profile, fleet, exclude_nodes)
    return Explanation(
        profile.name,
        needs(profile),
        tuple(node_verdicts),
        tuple(fabric_verdicts),
        place_in(profile, fleet, exclude_nodes=exclude_nodes),
    )


def explain(
    profile: ModelProfile, snap: Snapshot, *, exclude_nodes: frozenset[str] = frozenset()
) -> Explanation:
    """Every node's verdict (reason, or score and rank), every fabric's, and where the next replica would go."""
    return explain_in(profile, Fleet(snap), exclude_nodes=exclude_nodes)
