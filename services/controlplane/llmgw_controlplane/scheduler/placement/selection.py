"""Selection: the best-ranked feasible node (or fabric of whole nodes) for the next replica, and why."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.placement.feasibility import profile_problem
from llmgw_controlplane.scheduler.placement.fleet import Fleet
from llmgw_controlplane.scheduler.placement.ranking import Ranker
from llmgw_controlplane.scheduler.placement.score import ScoreKey, fabric_key, key_node
from llmgw_controlplane.scheduler.placement.types import Placement, ShardPlan, Unplaceable
from llmgw_controlplane.scheduler.placement.verdicts import unplaceable
from llmgw_controlplane.scheduler.snapshot import Snapshot

# A single-node profile takes the fast path when at least this many nodes pass the static filters and they
# are at least a quarter of the fleet.
_FAST_MIN = 64


def place(
    profile: ModelProfile,
    snap: Snapshot,
    *,
    exclude_nodes: frozenset[str] = frozenset(),
    extra_used: Mapping[str, AbstractSet[int]] | None = None,
) -> Placement | Unplaceable:
    """Where one more replica of ``profile`` goes, or why no node (or fabric) can take it.

    ``extra_used`` holds GPUs already promised in the same pass, per node. Pure: same inputs, same answer.
    """
    return place_in(profile, Fleet(snap, extra_used), exclude_nodes=exclude_nodes)


def place_in(
    profile: ModelProfile, fleet: Fleet, *, exclude_nodes: frozenset[str] = frozenset(), detail: bool = True
) -> Placement | Unplaceable:
    """:func:`place` over a pass's :class:`Fleet`; the caller calls ``fleet.take()`` if it keeps the result.

    ``detail=False`` answers a refusal without its reasons (``reasons == ()`` and ``summary == ""``): the
    decision is as exact, and it costs no verdict per node, for a caller that already holds recent reasons.
    """
    if profile_problem(profile) is not None:
        return unplaceable(profile, fleet, exclude_nodes)
    ok, _ = fleet.static(profile, exclude_nodes)
    if profile.nodes == 1:
        return _place_single(profile, fleet, ok, exclude_nodes, detail)
    return _place_multi(profile, fleet, ok, exclude_nodes, detail)


def _place_single(
    profile: ModelProfile, fleet: Fleet, ok: list[str], exclude: frozenset[str], detail: bool
) -> Placement | Unplaceable:
    cls = profile.gpu_class
    need = profile.gpus
    ranker = Ranker(fleet, profile)
    best: ScoreKey | None = None
    # Large candidate sets: score the few nodes with a non-default score one by one, and find the best
    # of all others from the packing index (the first fitting node in it is the best of them).
    fast = len(ok) * 4 >= len(fleet.names) and len(ok) > _FAST_MIN
    special = ranker.special() if fast else set()
    for name in (special & fleet.static_set(profile, exclude)) if fast else ok:
        free: int | None = None
        if cls is not None:
            free = len(fleet.free(name, cls))
            if free < need:
                continue
        key = ranker.key(name, fleet.node(name).fabric, free)
        if best is None or key < best:
            best = key
    if fast:
        generic = ranker.best_default(fleet.static_set(profile, exclude), special)
        if generic is not None and (best is None or generic < best):
            best = generic
    if best is None:
        return unplaceable(profile, fleet, exclude) if detail else Unplaceable(profile.name, (), "")
    chosen = key_node(best)
    gpus = tuple(fleet.free(chosen, cls)[:need]) if cls is not None else ()
    return Placement(profile.name, (ShardPlan(chosen, gpus),), _why(profile, fleet, [chosen], len(ok)))


def _place_multi(
    profile: ModelProfile, fleet: Fleet, ok: list[str], exclude: frozenset[str], detail: bool
) -> Placement | Unplaceable:
    cls = profile.gpu_class
    need = profile.gpus
    key = Ranker(fleet, profile).key
    nodes = fleet.snap.nodes
    eligible = fleet.static_set(profile, exclude)
    by_fabric: dict[str, list[tuple[ScoreKey, str]]] = {}
    # Nodes with room for a shard, from the packing index (free GPUs of the class, or for CPU shards run):
    # it already knows each node's free count, and skips the nodes without room wholesale.
    for pack, names in fleet.pack_index(cls).items():
        if cls is not None and pack < need:
            continue
        free = pack if cls is not None else None
        for name in names:
            fabric = nodes[name].fabric
            if fabric is not None and name in eligible:
                by_fabric.setdefault(fabric, []).append((key(name, fabric, free), name))
    best_key: tuple[int, int, int, int, str] | None = None
    chosen: list[str] = []
    for fabric, cands in by_fabric.items():
        if len(cands) < profile.nodes:
            continue
        cands.sort()
        pick = cands[: profile.nodes]
        fkey = fabric_key([k for k, _ in pick], fabric)
        if best_key is None or fkey < best_key:
            best_key, chosen = fkey, [name for _, name in pick]
    if best_key is None:
        return unplaceable(profile, fleet, exclude) if detail else Unplaceable(profile.name, (), "")
    shards = tuple(
        ShardPlan(name, tuple(fleet.free(name, cls)[:need]) if cls is not None else ()) for name in chosen
    )
    return Placement(profile.name, shards, _why(profile, fleet, chosen, len(ok)))


def _why(profile: ModelProfile, fleet: Fleet, chosen: list[str], candidates: int) -> tuple[str, ...]:
    out: list[str] = []
    if len(chosen) > 1:
        fabric = fleet.node(chosen[0]).fabric
        out.append(f"fabric {fabric} has {len(chosen)} whole nodes for it; leader {chosen[0]}")
    for name in chosen:
        n = fleet.node(name)
        w = fleet.weights(profile.weights_name, name)
        if w == "local":
            out.append(f"{name} holds the weights {profile.weights_name} locally")
        elif w == "shared":
            out.append(
                f"{name} sees the weights {profile.weights_name} on shared storage in fabric {n.fabric}"
            )
        if profile.gpu_class is not None:
            free = len(fleet.free(name, profile.gpu_class))
            out.append(f"{name} has {free} free {profile.gpu_class}: packing leaves {free - profile.gpus}")
        else:
            out.append(f"{name} runs {fleet.load(name)} shards, the fewest of the best candidates (spread)")
        others = fleet.model_on_node(profile.name, name)
        if others:
            out.append(
                f"{name} already runs {others} replica(s) of {profile.name}: no better node can hold it"
            )
    out.append(f"{candidates} of {len(fleet.names)} nodes passed the node filters")
    return tuple(out)
