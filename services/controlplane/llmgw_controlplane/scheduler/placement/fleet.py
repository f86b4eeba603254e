"""The fleet index: one pass's working view of a snapshot, built once and updated as the pass places."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.placement.feasibility import Shape, shape, static_reject
from llmgw_controlplane.scheduler.placement.types import NodeRejection, Placement, Unplaceable
from llmgw_controlplane.scheduler.snapshot import NodeView, Snapshot


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
        self._static_sets: dict[Shape, frozenset[str]] = {}
        self._model_node: dict[str, Counter[str]] = {}
        self._model_fabric: dict[str, Counter[str]] = {}
        for r in snap.replicas:
            self._count(r.model, [s.node for s in r.shards])
        self._local: dict[str, set[str]] | None = None
        self._shared: dict[str, set[str]] = {}
        self._static: dict[Shape, tuple[list[str], list[NodeRejection]]] = {}
        # Shapes no node could take in this pass. Capacity only shrinks as a pass goes on, so another
        # model of the same shape cannot fit either: its answer is reused instead of recomputed.
        self.failed: dict[tuple[Shape, int, int], Unplaceable] = {}

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

    def loads(self) -> Mapping[str, int]:
        return self._load

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

    def members(self, fabric: str) -> list[str]:
        """The fabric's nodes, sorted by name."""
        if self._members is None:
            members: dict[str, list[str]] = {}
            for name in self.names:
                f = self.snap.nodes[name].fabric
                if f is not None:
                    members.setdefault(f, []).append(name)
            self._members = members
        return self._members.get(fabric, [])

    def static(self, profile: ModelProfile, exclude: frozenset[str]) -> tuple[list[str], list[NodeRejection]]:
        """Nodes passing the filters that do not depend on free GPUs, and the rejections; cached per shape."""
        key = shape(profile, exclude)
        hit = self._static.get(key)
        if hit is None:
            ok: list[str] = []
            rejected: list[NodeRejection] = []
            for name in self.names:
                why = static_reject(self.snap.nodes[name], profile, exclude)
                if why is None:
                    ok.append(name)
                else:
                    rejected.append(NodeRejection(name, why[1], why[0]))
            hit = (ok, rejected)
            self._static[key] = hit
        return hit

    def static_set(self, profile: ModelProfile, exclude: frozenset[str]) -> frozenset[str]:
        """:meth:`static`'s passing nodes as a set, cached per shape."""
        key = shape(profile, exclude)
        hit = self._static_sets.get(key)
        if hit is None:
            hit = frozenset(self.static(profile, exclude)[0])
            self._static_sets[key] = hit
        return hit

    def pack_index(self, cls: str | None) -> dict[int, list[str]]:
        """Nodes by packing value, each list sorted by name: free GPUs of the class, or (CPU) shards run."""
        idx = self._pack.get(cls)
        if idx is None:
            idx = {}
            for name in self.names:
                idx.setdefault(self._pack_value(cls, name), []).append(name)
            self._pack[cls] = idx
        return idx

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

    # ------------------------------------------------------------ internals

    def _pack_value(self, cls: str | None, name: str) -> int:
        return len(self.free(name, cls)) if cls is not None else self._load[name]

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
