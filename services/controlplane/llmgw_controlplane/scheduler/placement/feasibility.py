"""Feasibility: which nodes (and, for multi-node replicas, which fabrics) can take a replica at all.

Each filter answers ``None`` (passes) or why it refuses, in the user's terms ("has 8 GB of memory,
needs 24"). :data:`NODE_FILTERS` runs them in stage order and the first refusal is the node's reason.
The static filters read the node and the profile only, so their answer is cached per :data:`Shape`;
the free-GPU and fabric checks depend on what a pass has already taken and run per placement.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet

from llmgw_common.catalog import ModelProfile, needs_gpu
from llmgw_controlplane.scheduler.placement.types import (
    Stage,
)
from llmgw_controlplane.scheduler.snapshot import NodeState, NodeView

# What the node filters read of a profile (engine, selector, memory, GPU class, excluded nodes).
Shape = tuple[str, tuple[tuple[str, str], ...], float | None, str | None, frozenset[str]]

# A node filter: None if the node passes, else why not.
NodeFilter = Callable[[NodeView, ModelProfile, AbstractSet[str]], str | None]


def shape(profile: ModelProfile, exclude: frozenset[str]) -> Shape:
    """What the node filters read of a profile: profiles of one shape pass and fail the same nodes."""
    return (
        profile.engine,
        tuple(sorted(profile.node_selector.items())),
        profile.min_memory_gb,
        profile.gpu_class,
        exclude,
    )


def profile_problem(profile: ModelProfile) -> str | None:
    """A profile no node could ever take, whatever the fleet."""
    if needs_gpu(profile):
        return f"engine {profile.engine} needs a GPU: model {profile.name} has no gpu_class"
    return None


def _num(x: float) -> str:
    return f"{x:g}"


# ---------------------------------------------------------------- static node filters, in stage order


def ready(node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]) -> str | None:
    if node.state is NodeState.READY:
        return None
    why = "missed heartbeats" if node.state is NodeState.UNREACHABLE else "silent past the lost timeout"
    return f"is {node.state.value} ({why})"


def not_cordoned(node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]) -> str | None:
    return "is cordoned" if node.cordoned else None


def not_draining(node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]) -> str | None:
    return "is draining" if node.draining else None


def not_excluded(node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]) -> str | None:
    return "is excluded from this placement" if node.name in exclude else None


def offers_engine(node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]) -> str | None:
    if profile.engine in node.engines:
        return None
    offers = ", ".join(sorted(node.engines)) or "none"
    return f"does not offer engine {profile.engine} (offers {offers})"


def matches_selector(node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]) -> str | None:
    for key, want in sorted(profile.node_selector.items()):
        have = node.labels.get(key)
        if have is None:
            return f"lacks label {key}={want}"
        if have != want:
            return f"has label {key}={have}, needs {key}={want}"
    return None


def enough_memory(node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]) -> str | None:
    # Unknown memory is not small memory (#3): only a reported figure can refuse.
    if (
        profile.min_memory_gb is not None
        and node.memory_gb is not None
        and node.memory_gb < profile.min_memory_gb
    ):
        return f"has {_num(node.memory_gb)} GB of memory, needs {_num(profile.min_memory_gb)}"
    return None


def has_gpu_class(node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]) -> str | None:
    cls = profile.gpu_class
    if cls is None or any(g.gpu_class == cls for g in node.gpus):
        return None
    classes = sorted({g.gpu_class for g in node.gpus})
    if not classes:
        return f"has no GPUs, needs {cls}"
    return f"has no {cls} GPUs (has {', '.join(classes)})"


NODE_FILTERS: tuple[tuple[Stage, NodeFilter], ...] = (
    (Stage.STATE, ready),
    (Stage.CORDON, not_cordoned),
    (Stage.DRAIN, not_draining),
    (Stage.EXCLUDED, not_excluded),
    (Stage.ENGINE, offers_engine),
    (Stage.SELECTOR, matches_selector),
    (Stage.MEMORY, enough_memory),
    (Stage.CLASS, has_gpu_class),
)


def static_reject(
    node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]
) -> tuple[Stage, str] | None:
    """The first static filter that refuses the node, as (stage, reason); None if all pass."""
    for stage, refuses in NODE_FILTERS:
        why = refuses(node, profile, exclude)
        if why is not None:
            return stage, why
    return None


# ---------------------------------------------------------------- what a pass left (Stage.GPUS, Stage.FABRIC)


def gpu_shortage(node: NodeView, used: AbstractSet[int], cls: str, free: int, need: int) -> str:
    """Why ``free`` healthy, unused GPUs of the class are too few: unhealthy ones named, used ones counted."""
    parts = [f"has {free} free {cls}, needs {need}"]
    in_use = 0
    for g in node.gpus:
        if g.gpu_class != cls:
            continue
        if not g.healthy:
            parts.append(f"GPU {g.index} unhealthy" + (f": {', '.join(g.reasons)}" if g.reasons else ""))
        elif g.index in used:
            in_use += 1
    if in_use:
        parts.append(f"{in_use} in use by replicas")
    return "; ".join(parts)


NO_FABRIC = "has no fabric"


def no_fabric(profile: ModelProfile) -> str:
    return f"{NO_FABRIC}; a {profile.nodes}-node replica needs whole nodes in one fabric"


def fabric_short(profile: ModelProfile, fabric: str, have: int) -> str:
    nodes = "node" if have == 1 else "nodes"
    if profile.gpu_class is None:
        return f"fabric {fabric} has {have} eligible {nodes}, needs {profile.nodes}"
    return f"fabric {fabric} has {have} {nodes} with {profile.gpus} free {profile.gpu_class}, needs {profile.nodes}"
