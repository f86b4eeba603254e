"""Ranking: :class:`Ranker` scores nodes for one profile over a pass's fleet, with :mod:`score`'s key.

:func:`score.score_key` is the only place the order of the criteria is written; :class:`Ranker` reads its
inputs from a pass's :class:`Fleet` for one profile, and the selection, the fast path and explain all
rank through it, so ``ctl explain-placement`` ranks exactly as placement decides.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.placement.fleet import Fleet
from llmgw_controlplane.scheduler.placement.score import NodeScore, ScoreKey, score_key


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
