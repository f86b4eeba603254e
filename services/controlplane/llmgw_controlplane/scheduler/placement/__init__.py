"""Placement: where the next replica of a model goes, or exactly why it cannot go anywhere.

Pure and synchronous, Nomad's pipeline over a :class:`Snapshot` (one module per stage):

- ``types``: what it answers: :class:`Placement`, :class:`Unplaceable` (every node's reason),
  :class:`Explanation`.
- ``fleet``: :class:`Fleet`, one pass's index of the snapshot (free healthy GPUs, who hosts what, who holds
  which weights), built once and updated with ``take()`` so a pass never double-books a GPU.
- ``feasibility``: filters in stage order, each refusing with a reason in the user's terms (#9); the
  free-GPU and fabric checks come last.
- ``score`` and ``ranking``: the one score (``score_key``): fewest replicas of the model on the node, holds the weights,
  fewest in its fabric, packing, name; a fabric's score for multi-node replicas is built from it.
- ``selection``: :func:`place` / :func:`place_in`: the best node (fast path: packing index), or the best
  fabric of whole nodes for a multi-node replica.
- ``verdicts`` and ``explain``: every node's and fabric's verdict, the one-line refusal, and
  ``ctl explain-placement``.
"""

from llmgw_controlplane.scheduler.placement.explain import explain, explain_in
from llmgw_controlplane.scheduler.placement.fleet import Fleet
from llmgw_controlplane.scheduler.placement.score import NodeScore
from llmgw_controlplane.scheduler.placement.selection import place, place_in
from llmgw_controlplane.scheduler.placement.types import (
    Explanation,
    FabricRejection,
    FabricVerdict,
    NodeRejection,
    NodeVerdict,
    Placement,
    ShardPlan,
    Stage,
    Unplaceable,
)
from llmgw_controlplane.scheduler.placement.verdicts import summarize

__all__ = [
    "Explanation",
    "FabricRejection",
    "FabricVerdict",
    "Fleet",
    "NodeRejection",
    "NodeScore",
    "NodeVerdict",
    "Placement",
    "ShardPlan",
    "Stage",
    "Unplaceable",
    "explain",
    "explain_in",
    "place",
    "place_in",
    "summarize",
]
