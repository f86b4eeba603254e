"""Ranking: the one score every feasible node gets, and the fabric score built from it.

:func:`score_key` is the only place the order of the criteria is written; :class:`Ranker` reads its
inputs from a pass's :class:`Fleet` for one profile, and the selection, the fast path and explain all
rank through it, so ``ctl explain-placement`` ranks exactly as placement decides.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.placement.fleet import Fleet

# Lower sorts first: (replicas of the model on the node, 0 if it holds the weights else 1, replicas of
# the model in its fabric, packing value, node name).
ScoreKey = tuple[int, int, int, int, str]


def score_key(
    model_on_node: int, holds_weights: bool, model_in_fabric: int, pack: int, name: str
) -> ScoreKey:
    """The score, most important first (the lowest key wins):

    1. replicas of this model already on the node: two replicas on one node share its fate;
    2. the node holds the weights (locally, or on shared storage seen in its fabric): a preference only,
       never a filter, and a node that never looked ranks with one that found nothing (#4, #6);
    3. replicas of this model already in the node's fabric: spread over fabrics where possible;
    4. ``pack``: for GPU profiles the free GPUs of the class left after placing (bin-packing keeps whole
       nodes free for multi-node replicas); for CPU profiles the shards the node already runs (spread);
    5. the node name, so ties are broken the same way every time.
    """
    return (model_on_node, 0 if holds_weights else 1, model_in_fabric, pack, name)


def fabric_key(picks: list[ScoreKey], fabric: str) -> tuple[int, int, int, int, str]:
    """A fabric's score for a multi-node replica, from the keys of the nodes it would use (best first):
    the criteria summed over them (the fabric's own count once), then the fabric name."""
    return (
        sum(k[0] for k in picks),
        sum(k[1] for k in picks),
        picks[0][2],
        sum(k[3] for k in picks),
        fabric,
    )


@dataclass(frozen=True, slots=True)
class NodeScore:
    """A node's score in parts, as ``ctl explain-placement`` shows it."""

    model_on_node: int
    # "local", "shared" (seen on shared storage in the node's fabric) or None: not known to hold them.
    weights: str | None
    model_in_fabric: int
    # GPU profiles: free GPUs of the class left after placing; None for CPU profiles.
    free_after: int | None
    # Shards the node runs already (any model).
    load: int

    def key(self, name: str) -> ScoreKey:
        pack = self.free_after if self.free_after is not None else self.load
        return score_key(self.model_on_node, self.weights is not None, self.model_in_fabric, pack, name)


class Ranker:
    """Scores nodes for one profile over one pass's :class:`Fleet` (read at construction: build one per
    placement, after the last ``fleet.take()``)."""

    __slots__ = (
        "_cls",
        "_fleet",
        "_gpu",
        "_holders",
        "_in_fabric",
        "_load",
        "_need",
        "_on_node",
        "_shared_in",
    )

    def __init__(self, fleet: Fleet, profile: ModelProfile) -> None:
        self._fleet = fleet
        self._need = profile.gpus
        self._cls = profile.gpu_class
        self._gpu = profile.gpu_class is not None
        self._on_node, self._holders, self._shared_in, self._in_fabric = fleet.score_tables(profile)
        self._load = fleet.loads()

    def key(self, name: str, fabric: str | None, free: int | None) -> ScoreKey:
        """The node's score key; ``free`` is its free GPUs of the class, None for a CPU profile.

        Runs once per eligible node, so it reads the tables directly rather than building a NodeScore.
        """
        return score_key(
            self._on_node.get(name, 0),
            name in self._holders or fabric in self._shared_in,
            self._in_fabric.get(fabric, 0) if fabric is not None else 0,
            free - self._need if free is not None else self._load[name],
            name,
        )

    def score(self, name: str, free: int | None) -> NodeScore:
        """The node's score in parts (``free`` as for :meth:`key`)."""
        fabric = self._fleet.node(name).fabric
        weights = (
            "local"
            if name in self._holders
            else "shared"
            if fabric is not None and fabric in self._shared_in
            else None
        )
        return NodeScore(
            model_on_node=self._on_node.get(name, 0),
            weights=weights,
            model_in_fabric=self._in_fabric.get(fabric, 0) if fabric is not None else 0,
            free_after=None if free is None else free - self._need,
            load=self._load[name],
        )

    # ------------------------------------------------------------ the fast path

    def special(self) -> set[str]:
        """Nodes whose score is not the default one: they host the model, hold its weights, or share a fabric
        with a replica of it or with its shared weights. Every other node scores only on packing."""
        out = set(self._on_node)
        out.update(self._holders)
        for f in set(self._in_fabric) | set(self._shared_in):
            out.update(self._fleet.members(f))
        return out

    def best_default(self, ok: AbstractSet[str], special: AbstractSet[str]) -> ScoreKey | None:
        """The best node in ``ok`` but not in ``special`` (so with the default score): the first one that
        fits in packing order."""
        idx = self._fleet.pack_index(self._cls)
        need = self._need
        for k in sorted(idx):
            if self._gpu and k < need:
                continue
            for name in idx[k]:
                if name in ok and name not in special:
                    return score_key(0, False, 0, k - need if self._gpu else k, name)
        return None
