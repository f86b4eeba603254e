"""What placement answers: a :class:`Placement`, an :class:`Unplaceable` with every node's reason, and
(for ``ctl explain-placement``) an :class:`Explanation` with every node's and fabric's verdict.

What it takes is a :class:`~llmgw_common.catalog.ModelProfile` and a
:class:`~llmgw_controlplane.scheduler.snapshot.Snapshot`, both defined elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from llmgw_controlplane.scheduler.placement.score import NodeScore


class Stage(IntEnum):
    """How far a node got through the filters, in their order: a later stage is closer to fitting, so
    its reason is the more useful one to show first."""

    STATE = 0
    CORDON = 1
    DRAIN = 2
    EXCLUDED = 3
    ENGINE = 4
    SELECTOR = 5
    MEMORY = 6
    CLASS = 7
    GPUS = 8
    FABRIC = 9


@dataclass(frozen=True, slots=True)
class ShardPlan:
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    model: str
    # Shard 0 first: the leader of a multi-node replica.
    shards: tuple[ShardPlan, ...]
    # Why these nodes, in the user's terms.
    reasons: tuple[str, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.shards)


@dataclass(frozen=True, slots=True)
class NodeRejection:
    node: str
    reason: str
    stage: Stage = Stage.STATE


@dataclass(frozen=True, slots=True)
class FabricRejection:
    fabric: str
    reason: str
    # Nodes of the fabric that passed every node filter (fewer than the replica needs).
    eligible: int = 0


@dataclass(frozen=True, slots=True)
class Unplaceable:
    model: str
    reasons: tuple[NodeRejection, ...]
    # The best one-line explanation, identical reasons grouped with counts.
    summary: str
    # Multi-node replicas: why no fabric had enough whole nodes.
    fabrics: tuple[FabricRejection, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    node: str
    fabric: str | None
    feasible: bool
    reason: str | None = None
    stage: Stage | None = None
    score: NodeScore | None = None
    # 1 = where the next single-node replica would go; None when not feasible.
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class FabricVerdict:
    fabric: str
    eligible_nodes: tuple[str, ...]
    needed: int
    feasible: bool
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Explanation:
    model: str
    # What one replica needs, in words ("2 nodes x 8 H100-80GB, engine vllm").
    needs: str
    nodes: tuple[NodeVerdict, ...]
    fabrics: tuple[FabricVerdict, ...]
    next: Placement | Unplaceable
