"""Placement: where the next replica of a model goes, or exactly why it cannot go anywhere.

The pipeline is Nomad's: feasibility filters → scores → select. It is pure and synchronous: it reads a
:class:`Snapshot` (through a :class:`Fleet`, a per-pass index of it) and nothing else. Every node a
filter rejects is recorded with a reason in the user's terms (ARCHITECTURE #9).

Scores, most important first (lower sort key wins):

1. replicas of this model already on the node: two replicas on one node share its fate;
2. the node holds the weights (locally, or on shared storage seen in its fabric): a preference only,
   never a filter, and a node that never looked ranks with one that found nothing (#4, #6);
3. replicas of this model already in the node's fabric: spread over fabrics where possible;
4. GPU profiles: free GPUs of the class left after placing (bin-packing keeps whole nodes free for
   multi-node replicas); CPU profiles: shards the node already runs (spread);
5. the node name, so ties are broken the same way every time.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from llmgw_common.catalog import CPU_ENGINES, ModelProfile
from llmgw_controlplane.snapshot import NodeState, NodeView, Snapshot

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

_SUMMARY_GROUPS = 4
_NAMES_SHOWN = 3


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
class NodeScore:
    model_on_node: int
    # "local", "shared" (seen on shared storage in the node's fabric) or None: not known to hold them.
    weights: str | None
    model_in_fabric: int
    # GPU profiles: free GPUs of the class left after placing; None for CPU profiles.
    free_after: int | None
    # Shards the node runs already (any model).
    load: int

    def key(self, name: str) -> tuple[int, int, int, int, str]:
        pack = self.free_after if self.free_after is not None else self.load
        return (self.model_on_node, 0 if self.weights else 1, self.model_in_fabric, pack, name)


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


_Shape = tuple[str, tuple[tuple[str, str], ...], float | None, str | None, frozenset[str]]


class Fleet:
    """One pass's working index of a snapshot: free healthy GPUs, who hosts what, who holds which weights.

    Built once per pass and updated with :meth:`take` as the pass decides placements, so one pass never
    double-books a GPU. Owned by a single pass and never shared; it reads the snapshot only.
    """

    def __init__(self, snap: Snapshot, extra_used: Mapping[str, AbstractSet[int]] | None = None) -> None:
        self.snap = snap
        self.names: tuple[str, ...] = tuple(sorted(snap.nodes))
        self._used: dict[str, set[int]] = snap.used_gpus()
        for node, gpus in (extra_used or {}).items():
            self._used.setdefault(node, set()).update(gpus)
        self._free: dict[str, dict[str, list[int]]] = {}
        self._load: Counter[str] = Counter()
        self._pack: dict[str | None, dict[int, list[str]]] = {}
        self._members: dict[str, list[str]] | None = None
        self._static_sets: dict[_Shape, frozenset[str]] = {}
        self._model_node: dict[str, Counter[str]] = {}
        self._model_fabric: dict[str, Counter[str]] = {}
        for r in snap.replicas:
            self._count(r.model, [s.node for s in r.shards])
        self._local: dict[str, set[str]] | None = None
        self._shared: dict[str, set[str]] = {}
        self._static: dict[_Shape, tuple[list[str], list[NodeRejection]]] = {}
        # Shapes no node could take in this pass. Capacity only shrinks as a pass goes on, so another
        # model of the same shape cannot fit either: its answer is reused instead of recomputed.
        self.failed: dict[tuple[_Shape, int, int], Unplaceable] = {}

    # ------------------------------------------------------------ queries

    def node(self, name: str) -> NodeView:
        return self.snap.nodes[name]

    def used(self, name: str) -> set[int]:
        return self._used.get(name, set())

    def free(self, name: str, gpu_class: str) -> list[int]:
        """Healthy GPUs of the class not held by any replica, lowest index first (#2: unhealthy never free)."""
        per = self._free.get(name)
        if per is None:
            per = {}
            used = self._used.get(name, ())
            for g in self.snap.nodes[name].gpus:
                if g.healthy and g.index not in used:
                    per.setdefault(g.gpu_class, []).append(g.index)
            for lst in per.values():
                lst.sort()
            self._free[name] = per
        return per.get(gpu_class, [])

    def load(self, name: str) -> int:
        return self._load[name]

    def model_on_node(self, model: str, name: str) -> int:
        c = self._model_node.get(model)
        return c[name] if c else 0

    def model_in_fabric(self, model: str, fabric: str | None) -> int:
        if fabric is None:
            return 0
        c = self._model_fabric.get(model)
        return c[fabric] if c else 0

    def weights(self, weights_name: str, name: str) -> str | None:
        """ "local", "shared" or None. Shared storage counts for its fabric only, local for its node only (#6)."""
        if self._local is None:
            self._index_weights()
        assert self._local is not None
        if name in self._local.get(weights_name, ()):
            return "local"
        fabric = self.snap.nodes[name].fabric
        if fabric is not None and fabric in self._shared.get(weights_name, ()):
            return "shared"
        return None

    def score_tables(
        self, profile: ModelProfile
    ) -> tuple[Mapping[str, int], AbstractSet[str], AbstractSet[str], Mapping[str, int]]:
        """What a score reads, as plain tables: replicas of the model per node, nodes holding the weights
        locally, fabrics with them on shared storage, replicas of the model per fabric."""
        if self._local is None:
            self._index_weights()
        wn = profile.weights_name
        return (
            self._model_node.get(profile.name, {}),
            (self._local or {}).get(wn, set()),
            self._shared.get(wn, set()),
            self._model_fabric.get(profile.name, {}),
        )

    def loads(self) -> Mapping[str, int]:
        return self._load

    def score(self, profile: ModelProfile, name: str, free: int | None) -> NodeScore:
        fabric = self.snap.nodes[name].fabric
        return NodeScore(
            model_on_node=self.model_on_node(profile.name, name),
            weights=self.weights(profile.weights_name, name),
            model_in_fabric=self.model_in_fabric(profile.name, fabric),
            free_after=None if free is None else free - profile.gpus,
            load=self._load[name],
        )

    # ------------------------------------------------------------ updates

    def take(self, placement: Placement) -> None:
        """Record a decided placement: its GPUs are no longer free, its nodes now host the model."""
        nodes = [s.node for s in placement.shards]
        before = {(cls, n): self._pack_value(cls, n) for cls in self._pack for n in nodes}
        for s in placement.shards:
            self._used.setdefault(s.node, set()).update(s.gpus)
            self._free.pop(s.node, None)
        self._count(placement.model, nodes)
        for (cls, n), old in before.items():
            new = self._pack_value(cls, n)
            if new != old:
                idx = self._pack[cls]
                lst = idx[old]
                del lst[bisect_left(lst, n)]
                if not lst:
                    del idx[old]
                insort(idx.setdefault(new, []), n)

    # ------------------------------------------------------------ indexes for the fast path

    def _pack_value(self, cls: str | None, name: str) -> int:
        return len(self.free(name, cls)) if cls is not None else self._load[name]

    def pack_index(self, cls: str | None) -> dict[int, list[str]]:
        """Nodes by packing value, each list sorted by name: free GPUs of the class, or (CPU) shards run."""
        idx = self._pack.get(cls)
        if idx is None:
            idx = {}
            for name in self.names:
                idx.setdefault(self._pack_value(cls, name), []).append(name)
            self._pack[cls] = idx
        return idx

    def members(self, fabric: str) -> list[str]:
        if self._members is None:
            members: dict[str, list[str]] = {}
            for name in self.names:
                f = self.snap.nodes[name].fabric
                if f is not None:
                    members.setdefault(f, []).append(name)
            self._members = members
        return self._members.get(fabric, [])

    def special(self, model: str, weights_name: str) -> set[str]:
        """Nodes whose score is not the default one: they host the model, hold its weights, or share a fabric
        with a replica of it or with its shared weights. Every other node scores only on packing."""
        out = set(self._model_node.get(model, ()))
        if self._local is None:
            self._index_weights()
        out.update(self._local.get(weights_name, ()) if self._local else ())
        fabrics = set(self._model_fabric.get(model, ())) | self._shared.get(weights_name, set())
        for f in fabrics:
            out.update(self.members(f))
        return out

    def static_set(self, profile: ModelProfile, exclude: frozenset[str]) -> frozenset[str]:
        shape = _shape(profile, exclude)
        hit = self._static_sets.get(shape)
        if hit is None:
            hit = frozenset(self.static(profile, exclude)[0])
            self._static_sets[shape] = hit
        return hit

    # ------------------------------------------------------------ internals

    def _count(self, model: str, nodes: Iterable[str]) -> None:
        per_node = self._model_node.setdefault(model, Counter())
        fabrics: set[str] = set()
        for n in nodes:
            per_node[n] += 1
            self._load[n] += 1
            view = self.snap.nodes.get(n)
            if view is not None and view.fabric is not None:
                fabrics.add(view.fabric)
        if fabrics:
            per_fabric = self._model_fabric.setdefault(model, Counter())
            for f in fabrics:
                per_fabric[f] += 1

    def _index_weights(self) -> None:
        local: dict[str, set[str]] = {}
        shared: dict[str, set[str]] = {}
        for name, n in self.snap.nodes.items():
            for w in n.weights:
                if w.shared and n.fabric is not None:
                    shared.setdefault(w.name, set()).add(n.fabric)
                else:
                    # A shared mount on a node with no fabric can only be vouched for on that node.
                    local.setdefault(w.name, set()).add(name)
        self._local = local
        self._shared = shared

    def static(self, profile: ModelProfile, exclude: frozenset[str]) -> tuple[list[str], list[NodeRejection]]:
        """Nodes passing the filters that do not depend on free GPUs, and the rejections; cached per shape."""
        shape = _shape(profile, exclude)
        hit = self._static.get(shape)
        if hit is None:
            ok: list[str] = []
            rejected: list[NodeRejection] = []
            for name in self.names:
                why = _static_reject(self.snap.nodes[name], profile, exclude)
                if why is None:
                    ok.append(name)
                else:
                    rejected.append(NodeRejection(name, why[1], why[0]))
            hit = (ok, rejected)
            self._static[shape] = hit
        return hit


# ---------------------------------------------------------------- filters


def _shape(profile: ModelProfile, exclude: frozenset[str]) -> _Shape:
    """What the node filters read of a profile: profiles of one shape pass and fail the same nodes."""
    return (
        profile.engine,
        tuple(sorted(profile.node_selector.items())),
        profile.min_memory_gb,
        profile.gpu_class,
        exclude,
    )


def _num(x: float) -> str:
    return f"{x:g}"


def _static_reject(
    node: NodeView, profile: ModelProfile, exclude: AbstractSet[str]
) -> tuple[int, str] | None:
    if node.state is not NodeState.READY:
        why = "missed heartbeats" if node.state is NodeState.UNREACHABLE else "silent past the lost timeout"
        return STAGE_STATE, f"is {node.state.value} ({why})"
    if node.cordoned:
        return STAGE_CORDON, "is cordoned"
    if node.draining:
        return STAGE_DRAIN, "is draining"
    if node.name in exclude:
        return STAGE_EXCLUDED, "is excluded from this placement"
    if profile.engine not in node.engines:
        offers = ", ".join(sorted(node.engines)) or "none"
        return STAGE_ENGINE, f"does not offer engine {profile.engine} (offers {offers})"
    for key, want in sorted(profile.node_selector.items()):
        have = node.labels.get(key)
        if have is None:
            return STAGE_SELECTOR, f"lacks label {key}={want}"
        if have != want:
            return STAGE_SELECTOR, f"has label {key}={have}, needs {key}={want}"
    # Unknown memory is not small memory (#3): only a reported figure can refuse.
    if (
        profile.min_memory_gb is not None
        and node.memory_gb is not None
        and node.memory_gb < profile.min_memory_gb
    ):
        return STAGE_MEMORY, f"has {_num(node.memory_gb)} GB of memory, needs {_num(profile.min_memory_gb)}"
    cls = profile.gpu_class
    if cls is not None and not any(g.gpu_class == cls for g in node.gpus):
        classes = sorted({g.gpu_class for g in node.gpus})
        if not classes:
            return STAGE_CLASS, f"has no GPUs, needs {cls}"
        return STAGE_CLASS, f"has no {cls} GPUs (has {', '.join(classes)})"
    return None


def _gpu_shortage(fleet: Fleet, name: str, cls: str, free: int, need: int) -> str:
    node = fleet.node(name)
    used = fleet.used(name)
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


def _needs(profile: ModelProfile) -> str:
    per = f"{profile.gpus} {profile.gpu_class}" if profile.gpu_class else "no GPU"
    where = f"{profile.nodes} nodes x {per}" if profile.nodes > 1 else per
    return f"{where}, engine {profile.engine}"


def _profile_problem(profile: ModelProfile) -> str | None:
    if profile.gpu_class is None and profile.engine not in CPU_ENGINES:
        return f"engine {profile.engine} needs a GPU: model {profile.name} has no gpu_class"
    return None


# ---------------------------------------------------------------- verdicts (every node, with reasons)


def _verdicts(
    profile: ModelProfile, fleet: Fleet, exclude: frozenset[str]
) -> tuple[list[NodeVerdict], list[FabricVerdict]]:
    """Every node's verdict and every fabric's (multi-node), as the filters see them."""
    ok, rejected = fleet.static(profile, exclude)
    out: list[NodeVerdict] = [
        NodeVerdict(r.node, fleet.node(r.node).fabric, False, r.reason, r.stage) for r in rejected
    ]
    cls = profile.gpu_class
    need = profile.gpus
    passing: list[tuple[str, NodeScore]] = []
    for name in ok:
        fabric = fleet.node(name).fabric
        free: int | None = None
        if cls is not None:
            free = len(fleet.free(name, cls))
            if free < need:
                out.append(
                    NodeVerdict(name, fabric, False, _gpu_shortage(fleet, name, cls, free, need), STAGE_GPUS)
                )
                continue
        passing.append((name, fleet.score(profile, name, free)))
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
                    FabricVerdict(f, names, profile.nodes, False, _fabric_short(profile, f, len(names)))
                )
        short = {fv.fabric: fv.reason for fv in fabrics if not fv.feasible}
        kept: list[tuple[str, NodeScore]] = []
        for name, score in passing:
            f = fleet.node(name).fabric
            if f is None:
                why = f"has no fabric; a {profile.nodes}-node replica needs whole nodes in one fabric"
                out.append(NodeVerdict(name, None, False, why, STAGE_FABRIC))
            elif f in short:
                out.append(NodeVerdict(name, f, False, short[f], STAGE_FABRIC))
            else:
                kept.append((name, score))
        passing = kept
    passing.sort(key=lambda p: p[1].key(p[0]))
    for i, (name, score) in enumerate(passing, start=1):
        out.append(NodeVerdict(name, fleet.node(name).fabric, True, score=score, rank=i))
    out.sort(key=lambda v: v.node)
    return out, fabrics


def _fabric_short(profile: ModelProfile, fabric: str, have: int) -> str:
    nodes = "node" if have == 1 else "nodes"
    if profile.gpu_class is None:
        return f"fabric {fabric} has {have} eligible {nodes}, needs {profile.nodes}"
    return f"fabric {fabric} has {have} {nodes} with {profile.gpus} free {profile.gpu_class}, needs {profile.nodes}"


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
        if r.stage == STAGE_FABRIC and fabric_parts and not r.reason.startswith("has no fabric"):
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


def _unplaceable(profile: ModelProfile, fleet: Fleet, exclude: frozenset[str]) -> Unplaceable:
    problem = _profile_problem(profile)
    if problem is not None:
        return Unplaceable(profile.name, (), problem)
    key = (_shape(profile, exclude), profile.gpus, profile.nodes)
    seen = fleet.failed.get(key)
    if seen is not None:
        summary = summarize(profile.name, profile.nodes, seen.reasons, seen.fabrics)
        return Unplaceable(profile.name, seen.reasons, summary, seen.fabrics)
    verdicts, fabrics = _verdicts(profile, fleet, exclude)
    rejections = tuple(
        NodeRejection(v.node, v.reason or "", v.stage or 0) for v in verdicts if not v.feasible
    )
    frej = tuple(
        FabricRejection(f.fabric, f.reason or "", len(f.eligible_nodes)) for f in fabrics if not f.feasible
    )
    out = Unplaceable(
        profile.name, rejections, summarize(profile.name, profile.nodes, rejections, frej), frej
    )
    fleet.failed[key] = out
    return out


# ---------------------------------------------------------------- select


def place_in(
    profile: ModelProfile, fleet: Fleet, *, exclude_nodes: frozenset[str] = frozenset(), detail: bool = True
) -> Placement | Unplaceable:
    """:func:`place` over a pass's :class:`Fleet`; the caller calls ``fleet.take()`` if it keeps the result.

    ``detail=False`` answers a refusal without its reasons (``reasons == ()`` and ``summary == ""``): the
    decision is as exact, and it costs no verdict per node, for a caller that already holds recent reasons.
    """
    if _profile_problem(profile) is not None:
        return _unplaceable(profile, fleet, exclude_nodes)
    ok, _ = fleet.static(profile, exclude_nodes)
    cls = profile.gpu_class
    need = profile.gpus
    model = profile.name
    wn = profile.weights_name
    if profile.nodes == 1:
        best: tuple[int, int, int, int, str] | None = None
        # Large candidate sets: score the few nodes with a non-default score one by one, and find the best
        # of all others from the packing index (the first fitting node in it is the best of them).
        fast = len(ok) * 4 >= len(fleet.names) and len(ok) > 64
        special = fleet.special(model, wn) if fast else set()
        for name in (special & fleet.static_set(profile, exclude_nodes)) if fast else ok:
            free = -1
            if cls is not None:
                free = len(fleet.free(name, cls))
                if free < need:
                    continue
            n = fleet.node(name)
            key = (
                fleet.model_on_node(model, name),
                0 if fleet.weights(wn, name) else 1,
                fleet.model_in_fabric(model, n.fabric),
                free - need if cls is not None else fleet.load(name),
                name,
            )
            if best is None or key < best:
                best = key
        if fast:
            generic = _best_generic(fleet, profile, fleet.static_set(profile, exclude_nodes), special)
            if generic is not None and (best is None or generic < best):
                best = generic
        if best is None:
            return _unplaceable(profile, fleet, exclude_nodes) if detail else Unplaceable(model, (), "")
        chosen = best[4]
        gpus = tuple(fleet.free(chosen, cls)[:need]) if cls is not None else ()
        return Placement(model, (ShardPlan(chosen, gpus),), _why(profile, fleet, [chosen], len(ok)))
    return _place_multi(profile, fleet, ok, exclude_nodes, detail)


def _best_generic(
    fleet: Fleet, profile: ModelProfile, ok: frozenset[str], special: set[str]
) -> tuple[int, int, int, int, str] | None:
    """The best node whose score is the default one (no replica of the model near, no weights): the first
    fitting node in packing order."""
    idx = fleet.pack_index(profile.gpu_class)
    need = profile.gpus
    gpu = profile.gpu_class is not None
    for k in sorted(idx):
        if gpu and k < need:
            continue
        for name in idx[k]:
            if name in ok and name not in special:
                return (0, 1, 0, k - need if gpu else k, name)
    return None


def _place_multi(
    profile: ModelProfile, fleet: Fleet, ok: list[str], exclude: frozenset[str], detail: bool
) -> Placement | Unplaceable:
    cls = profile.gpu_class
    need = profile.gpus
    by_fabric: dict[str, list[tuple[tuple[int, int, int, int, str], str]]] = {}
    # The score inlined (NodeScore.key): this loop runs over every eligible node.
    on_node, holders, shared_in, in_fabric = fleet.score_tables(profile)
    nodes = fleet.snap.nodes
    load = fleet.loads()
    for name in ok:
        fabric = nodes[name].fabric
        if fabric is None:
            continue
        if cls is not None:
            free = len(fleet.free(name, cls))
            if free < need:
                continue
            pack = free - need
        else:
            pack = load[name]
        key = (
            on_node.get(name, 0),
            0 if name in holders or fabric in shared_in else 1,
            in_fabric.get(fabric, 0),
            pack,
            name,
        )
        by_fabric.setdefault(fabric, []).append((key, name))
    best: tuple[tuple[int, int, int, int, str], list[str]] | None = None
    for fabric, cands in by_fabric.items():
        if len(cands) < profile.nodes:
            continue
        cands.sort()
        pick = cands[: profile.nodes]
        fkey = (
            sum(k[0] for k, _ in pick),
            sum(k[1] for k, _ in pick),
            pick[0][0][2],
            sum(k[3] for k, _ in pick),
            fabric,
        )
        if best is None or fkey < best[0]:
            best = (fkey, [name for _, name in pick])
    if best is None:
        return _unplaceable(profile, fleet, exclude) if detail else Unplaceable(profile.name, (), "")
    chosen = best[1]
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


def explain_in(
    profile: ModelProfile, fleet: Fleet, *, exclude_nodes: frozenset[str] = frozenset()
) -> Explanation:
    problem = _profile_problem(profile)
    if problem is not None:
        return Explanation(profile.name, _needs(profile), (), (), Unplaceable(profile.name, (), problem))
    verdicts, fabrics = _verdicts(profile, fleet, exclude_nodes)
    return Explanation(
        profile.name,
        _needs(profile),
        tuple(verdicts),
        tuple(fabrics),
        place_in(profile, fleet, exclude_nodes=exclude_nodes),
    )


def explain(
    profile: ModelProfile, snap: Snapshot, *, exclude_nodes: frozenset[str] = frozenset()
) -> Explanation:
    """Every node's verdict (reason, or score and rank), every fabric's, and where the next replica would go."""
    return explain_in(profile, Fleet(snap), exclude_nodes=exclude_nodes)
