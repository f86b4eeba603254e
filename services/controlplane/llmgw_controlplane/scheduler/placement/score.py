"""The one score every feasible node gets (:func:`score_key`), its parts as explain shows them
(:class:`NodeScore`), and the fabric score built from it. Pure data: it reads nothing of a fleet, so the
answer types (:mod:`types`) can name it without depending on ranking.
"""

from __future__ import annotations

from dataclasses import dataclass

# Lower sorts first: (replicas of the model on the node, 0 if it holds the weights else 1, replicas of
# the model in its fabric, pack, node name): see score_key. A plain tuple, not a NamedTuple, because it is built once
# per eligible node per placement (a NamedTuple costs about four times as much to make); read its
# fields through the functions here, never by index elsewhere.
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


def key_node(key: ScoreKey) -> str:
    """The node a key scores."""
    return key[4]


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
