"""What placement answers: a :class:`Placement`, an :class:`Unplaceable` with every node's reason, and
(for ``ctl explain-placement``) an :class:`Explanation` with every node's and fabric's verdict.

What it takes is a :class:`~llmgw_common.catalog.ModelProfile` and a
:class:`~llmgw_controlplane.snapshot.Snapshot`, both defined elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw_controlplane.placement.ranking import NodeScore

# How far a node got through the filters: a later stage is closer to fitting, so its reason is the
# more useful one to show first.
STAGE_STATE = 0
STAGE_CORDON = 1
STAGE_DRAIN = 2
STAGE_EXCLUDED = 3
STAGE_ENGINE = 4
STAGE_SELECTOR = 5
STAGE_MEMORY = 6
STAGE_CLASS = 7
STAGE_GPUS = 8
STAGE_FABRIC = 9


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
    stage: int = STAGE_STATE


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
    stage: int | None = None
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
