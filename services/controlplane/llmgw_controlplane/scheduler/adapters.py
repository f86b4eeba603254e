"""Which replica of its base loads each LoRA adapter (issue 33): pure, over a snapshot, time in ``snap.now``.

An adapter has no replicas of its own. Each pass, :func:`decide_adapters` turns what is wanted of the
adapters (routers' requests in flight, queued or held for them; wakes asked for them; requests running
on them) into the adapters each replica of a base must have loaded: the ``adapters`` of that replica's
shard 0 assignment, which its agent converges to through the engine's runtime API. Rules:

- **Load where wanted.** An adapter wanted and loaded on no replica of its base is given to one: the
  replicas that run (ready before starting ones) with a free slot (``adapter_slots``) or an adapter to
  let go, on nodes that hold its weights first, then the least loaded. A replica whose last load of it
  failed is not asked again while its report says so.
- **Full replicas let go the least recently used**, and never an adapter with requests in flight: not one
  its replica reports busy, not one the routers hold or queue requests for, not one used within
  ``recent_use_s`` (reports of a request just sent are up to a tick old), not one loaded less than
  ``min_residency_s`` ago (its first requests may not show yet).
- **Spread a hot adapter**: with more requests than ``spread_per_replica`` per replica that has it, one
  more replica is given it (a free slot or an idle adapter only), one per pass; the extra copy is let go
  once the others would carry its requests at half that.
- **Let go the unused**: an adapter unwanted for ``idle_s`` is unloaded everywhere (never while busy).
- **Replacements**: an adapter used within ``idle_s`` whose replica went away (failed, stopped, drained)
  is given again to a running replica with a free slot, so a replacement serves it before it is asked.
- **Draining replicas** keep theirs (they finish what they hold).

What could not be done is said per adapter in ``waiting`` (for ``ctl models`` and the wake's answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from llmgw_common.catalog import AdapterProfile, ModelProfile, TargetKind
from llmgw_common.ctl import ReplicaPhase
from llmgw_common.messages import AdapterLoad
from llmgw_controlplane.scheduler.adapter_reports import AdapterSeen
from llmgw_controlplane.scheduler.phase import replica_phase, serving
from llmgw_controlplane.scheduler.snapshot import ReplicaView, Snapshot


def _frozen() -> Mapping[Any, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class AdapterPolicy:
    # Unwanted this long, an adapter is unloaded.
    idle_s: float = 600.0
    # Never let go sooner after its load was asked.
    min_residency_s: float = 15.0
    # Requests per replica holding a hot adapter above which one more replica loads it; a base whose
    # target is ``in_flight_per_replica`` uses that instead.
    spread_per_replica: float = 8.0
    # An adapter used this recently (requests reported for it, or running on it) is not let go: the
    # routers' and agents' reports of a request just sent are up to a tick old, and a request sent to a
    # replica that just unloaded its adapter waits for it to be loaded again.
    recent_use_s: float = 2.0
    # A replica whose load of an adapter failed is not asked for it again for this long (the agent may
    # stop reporting the error once the assignment no longer asks it).
    retry_failed_s: float = 300.0


@dataclass(frozen=True, slots=True)
class AdapterMemo:
    """What a pass hands the next: the adapters asked of each replica and when, use and counts."""

    # replica id -> adapters its assignment asks for, in the order they were asked
    assigned: Mapping[str, tuple[str, ...]] = field(default_factory=_frozen)
    # (replica id, adapter) -> when it was asked
    since: Mapping[tuple[str, str], float] = field(default_factory=_frozen)
    # adapter -> the last time it was wanted (requests, a wake, busy)
    used: Mapping[str, float] = field(default_factory=_frozen)
    loads: Mapping[str, int] = field(default_factory=_frozen)
    unloads: Mapping[str, int] = field(default_factory=_frozen)
    # (replica id, adapter) -> (why its load failed there, when that was last reported)
    failed: Mapping[tuple[str, str], tuple[str, float]] = field(default_factory=_frozen)
    # adapter -> since when it has been wanted and loaded nowhere: the longest waiting goes first
    waiting_since: Mapping[str, float] = field(default_factory=_frozen)

    @classmethod
    def from_assignments(cls, assigned: Mapping[str, tuple[str, ...]], now: float) -> AdapterMemo:
        """A new tenure starts from what the stored assignments ask (nothing is reloaded), as if each
        adapter had been asked and used just now (nothing is let go at once)."""
        since = {(r, a): now for r, names in assigned.items() for a in names}
        used = {a: now for names in assigned.values() for a in names}
        return cls(MappingProxyType(dict(assigned)), MappingProxyType(since), MappingProxyType(used))


@dataclass(frozen=True, slots=True)
class AdapterInputs:
    # replica id -> what its node reports of its adapters
    seen: Mapping[str, AdapterSeen] = field(default_factory=_frozen)
    # adapter -> requests the routers have in flight, queued or held for it
    demand: Mapping[str, int] = field(default_factory=_frozen)
    # adapters a wake asked for recently (their requests are held)
    wanted: AbstractSet[str] = frozenset()
    # adapters with requests since the last pass, however short (the routers' arrivals): used now
    touched: AbstractSet[str] = frozenset()


@dataclass(frozen=True, slots=True)
class AdapterMove:
    adapter: str
    replica_id: str
    why: str


@dataclass(frozen=True, slots=True)
class AdapterDecision:
    assigned: Mapping[str, tuple[str, ...]]
    loads: tuple[AdapterMove, ...]
    unloads: tuple[AdapterMove, ...]
    # adapter -> why it is wanted and loaded nowhere yet
    waiting: Mapping[str, str]
    memo: AdapterMemo


def slots_of(r: ReplicaView, profile: ModelProfile) -> int:
    """Adapters this replica holds: from the spec it was started with (its engine's flags), else its
    profile's."""
    s = r.spec
    if s is None:
        return profile.adapter_slots
    return 0 if s.max_loras is None else max(s.max_cpu_loras or 0, s.max_loras)


def holds_weights(snap: Snapshot, node: str, a: AdapterProfile) -> bool:
    n = snap.nodes.get(node)
    return n is not None and any(a.weights in (w.name, w.path) for w in n.weights)


def spread_threshold(base: ModelProfile, policy: AdapterPolicy) -> float:
    t = base.target
    if t is not None and t.kind is TargetKind.IN_FLIGHT:
        return t.value
    return policy.spread_per_replica


def adapter_loads(
    catalog_adapters: Mapping[str, AdapterProfile], names: tuple[str, ...]
) -> tuple[AdapterLoad, ...]:
    """What an assignment carries for ``names`` (adapters that left the catalog are dropped)."""
    return tuple(
        AdapterLoad(name=a.name, weights=a.weights, rank=a.rank)
        for n in names
        if (a := catalog_adapters.get(n)) is not None
    )


class _Base:
    """One base model's working state for one pass."""

    def __init__(
        self,
        snap: Snapshot,
        base: ModelProfile,
        memo: AdapterMemo,
        inputs: AdapterInputs,
        policy: AdapterPolicy,
        used: dict[str, float],
    ) -> None:
        self.snap, self.base, self.inputs, self.policy, self.used = snap, base, inputs, policy, used
        self.now = snap.now
        self.adapters = {a.name: a for a in snap.catalog.adapters_of(base.name)}
        mine = [r for r in snap.replicas if r.model == base.name]
        # Replicas that may be asked to load: running or starting, not draining, with slots.
        self.live = [
            r
            for r in mine
            if not r.draining
            and slots_of(r, base) > 0
            and replica_phase(snap, r) in (ReplicaPhase.READY, ReplicaPhase.STARTING)
        ]
        self.ready = {r.id for r in mine if serving(snap, r)}
        # Running, but started before the profile had max_loras: a roll replaces them.
        self.without_lora = sum(1 for r in mine if not r.draining and slots_of(r, base) == 0)
        self.draining = [r for r in mine if r.draining]
        self.cur: dict[str, list[str]] = {
            r.id: [a for a in memo.assigned.get(r.id, ()) if a in self.adapters] for r in self.live
        }
        for r in self.draining:
            self.cur[r.id] = [a for a in memo.assigned.get(r.id, ()) if a in self.adapters]
        self.since = memo.since
        self.failed = dict(memo.failed)
        for r in mine:
            seen = inputs.seen.get(r.id)
            for a, err in seen.errors.items() if seen is not None else ():
                if a in self.adapters:
                    self.failed[(r.id, a)] = (err, self.now)
        self.loads: list[AdapterMove] = []
        self.unloads: list[AdapterMove] = []
        self.new_since: dict[tuple[str, str], float] = {}

    # ------------------------------------------------------------ facts

    def seen(self, rid: str) -> AdapterSeen | None:
        return self.inputs.seen.get(rid)

    def busy(self, rid: str, a: str) -> bool:
        s = self.seen(rid)
        return s is not None and a in s.busy

    def wanted(self, a: str) -> bool:
        return self.inputs.demand.get(a, 0) > 0 or a in self.inputs.wanted

    def failed_on(self, rid: str, a: str) -> str | None:
        """Why the last load of ``a`` on this replica failed: as its report says, or as remembered for
        ``retry_failed_s``."""
        s = self.seen(rid)
        if s is not None and a in s.errors:
            return s.errors[a]
        kept = self.failed.get((rid, a))
        if kept is not None and self.now - kept[1] < self.policy.retry_failed_s:
            return kept[0]
        return None

    def asked_at(self, rid: str, a: str) -> float:
        return self.new_since.get((rid, a), self.since.get((rid, a), self.now))

    def may_let_go(self, rid: str, a: str) -> bool:
        """Never one with requests in flight (busy on it, or held and queued by routers) or just loaded."""
        if self.busy(rid, a) or self.inputs.demand.get(a, 0) > 0 or a in self.inputs.wanted:
            return False
        if self.now - self.used.get(a, float("-inf")) < self.policy.recent_use_s:
            return False
        return self.now - self.asked_at(rid, a) >= self.policy.min_residency_s

    def holders(self, a: str) -> list[str]:
        return [r.id for r in self.live if a in self.cur[r.id]]

    # ------------------------------------------------------------ moves

    def load(self, rid: str, a: str, why: str) -> None:
        self.cur[rid].append(a)
        self.new_since[(rid, a)] = self.now
        self.loads.append(AdapterMove(a, rid, why))

    def unload(self, rid: str, a: str, why: str) -> None:
        self.cur[rid].remove(a)
        self.unloads.append(AdapterMove(a, rid, why))

    def lru_victim(self, rid: str, keep: str) -> str | None:
        """The least recently used adapter this replica may let go, or None."""
        free = [c for c in self.cur[rid] if c != keep and self.may_let_go(rid, c)]
        return min(free, key=lambda c: (self.used.get(c, 0.0), c)) if free else None

    def choose(
        self, a: str, *, evict: bool, exclude: AbstractSet[str] = frozenset()
    ) -> tuple[str | None, str]:
        """The replica to load ``a`` (and what it lets go first, if anything), or None and why not."""
        ap = self.adapters[a]
        if not self.live:
            if self.without_lora:
                return None, (
                    f"the replicas of base {self.base.name} were started without LoRA (max_loras): "
                    "they are being replaced"
                )
            return None, f"no replica of base {self.base.name} runs"
        options: list[tuple[tuple[object, ...], str]] = []
        failed: list[str] = []
        full = 0
        slots = {r.id: slots_of(r, self.base) for r in self.live}
        nodes = {r.id: r.shards[0].node if r.shards else "" for r in self.live}
        for r in self.live:
            if r.id in exclude or a in self.cur[r.id]:
                continue
            err = self.failed_on(r.id, a)
            if err is not None:
                failed.append(f"replica {r.id}: {err}")
                continue
            room = len(self.cur[r.id]) < slots[r.id]
            if not room and (not evict or self.lru_victim(r.id, a) is None):
                full += 1
                continue
            s = self.seen(r.id)
            key = (
                r.id not in self.ready,
                not room,
                not holds_weights(self.snap, nodes[r.id], ap),
                s.load if s is not None and s.load is not None else 0.0,
                len(self.cur[r.id]),
                r.id,
            )
            options.append((key, r.id))
        if options:
            return min(options)[1], ""
        why = []
        if failed:
            why.append("its load failed: " + "; ".join(failed))
        if full:
            most = max(slots.values())
            why.append(
                f"{full} replica(s) of base {self.base.name} hold their {most} adapters, each in use or "
                "just loaded"
            )
        return None, "; ".join(why) or "every replica of its base has it"

    def give(self, a: str, why: str, *, evict: bool, exclude: AbstractSet[str] = frozenset()) -> str:
        rid, reason = self.choose(a, evict=evict, exclude=exclude)
        if rid is None:
            return reason
        slots = next(slots_of(r, self.base) for r in self.live if r.id == rid)
        if len(self.cur[rid]) >= slots:
            victim = self.lru_victim(rid, a)
            assert victim is not None  # choose() only offers a full replica that has one
            self.unload(rid, victim, f"least recently used, to make room for {a}")
        self.load(rid, a, why)
        return ""


def decide_adapters(
    snap: Snapshot, memo: AdapterMemo, inputs: AdapterInputs, policy: AdapterPolicy
) -> AdapterDecision:
    """Every base's adapters, decided (the module's docstring)."""
    now = snap.now
    used = dict(memo.used)
    names = set(snap.catalog.adapter_names)
    for a in names:
        if (
            inputs.demand.get(a, 0) > 0
            or a in inputs.wanted
            or a in inputs.touched
            or any(a in s.busy for s in inputs.seen.values())
        ):
            used[a] = now
    for a in [a for a in used if a not in names]:
        del used[a]
    assigned: dict[str, tuple[str, ...]] = {}
    since: dict[tuple[str, str], float] = {}
    loads: list[AdapterMove] = []
    unloads: list[AdapterMove] = []
    waiting: dict[str, str] = {}
    kept: dict[str, list[str]] = {}
    failed: dict[tuple[str, str], tuple[str, float]] = {}
    waiting_since: dict[str, float] = {}
    bases = {a.base for a in snap.catalog.adapters}
    for base in snap.catalog.models:
        if base.name not in bases:
            continue  # a catalog of hundreds of models, few with adapters: only those cost a pass anything
        b = _Base(snap, base, memo, inputs, policy, used)
        _decide_base(b, memo, waiting)
        waiting_since.update(
            {a: memo.waiting_since.get(a, now) for a in b.adapters if b.wanted(a) and not b.holders(a)}
        )
        for rid, names_ in b.cur.items():
            if names_:
                assigned[rid] = tuple(names_)
                for a in names_:
                    since[(rid, a)] = b.asked_at(rid, a)
        kept.update(b.cur)
        failed.update({k: v for k, v in b.failed.items() if now - v[1] < policy.retry_failed_s})
        loads += b.loads
        unloads += b.unloads
    # Replicas no longer running lost their adapters with them (failed, stopped, gone).
    for rid, had in memo.assigned.items():
        if rid not in kept:
            unloads += [AdapterMove(a, rid, "its replica stopped") for a in had if a in names]
    load_count = dict(memo.loads)
    unload_count = dict(memo.unloads)
    for m in loads:
        load_count[m.adapter] = load_count.get(m.adapter, 0) + 1
    for m in unloads:
        unload_count[m.adapter] = unload_count.get(m.adapter, 0) + 1
    keep = names
    return AdapterDecision(
        assigned=MappingProxyType(assigned),
        loads=tuple(loads),
        unloads=tuple(unloads),
        waiting=MappingProxyType(waiting),
        memo=AdapterMemo(
            assigned=MappingProxyType(assigned),
            since=MappingProxyType(since),
            used=MappingProxyType(used),
            loads=MappingProxyType({a: n for a, n in load_count.items() if a in keep}),
            unloads=MappingProxyType({a: n for a, n in unload_count.items() if a in keep}),
            failed=MappingProxyType(failed),
            waiting_since=MappingProxyType(waiting_since),
        ),
    )


def _decide_base(b: _Base, memo: AdapterMemo, waiting: dict[str, str]) -> None:
    now, policy = b.now, b.policy
    # A load that failed on a replica moves to another that may load it; with none, it stays asked there
    # (its error stays reported: requests for it are refused saying why, and ctl shows it).
    live = {r.id for r in b.live}
    for rid in [r for r in b.cur if r in live]:
        for a in list(b.cur[rid]):
            err = b.failed_on(rid, a)
            if err is not None and b.give(a, f"its load failed on {rid}", evict=True, exclude={rid}) == "":
                b.unload(rid, a, f"its load failed: {err}")
    # Over the slots (a spec with fewer): the least recently used go first.
    for r in b.live:
        slots = slots_of(r, b.base)
        while len(b.cur[r.id]) > slots and (victim := b.lru_victim(r.id, "")) is not None:
            b.unload(r.id, victim, f"over the replica's {slots} adapter slots")
    # Unused for idle_s: let go everywhere.
    for r in b.live:
        for a in list(b.cur[r.id]):
            if now - b.used.get(a, b.asked_at(r.id, a)) >= policy.idle_s and b.may_let_go(r.id, a):
                b.unload(r.id, a, f"unused for {policy.idle_s:g}s")
    hot = spread_threshold(b.base, policy)
    by_demand = sorted(b.adapters, key=lambda a: (-b.inputs.demand.get(a, 0), a))
    # Wanted and loaded nowhere: one replica, letting go its least recently used if it must; the one
    # waiting longest first, so that when slots are short no adapter waits behind newer ones for ever.
    by_wait = sorted(
        b.adapters, key=lambda a: (memo.waiting_since.get(a, b.now), -b.inputs.demand.get(a, 0), a)
    )
    for a in by_wait:
        if b.wanted(a) and not b.holders(a):
            why = b.give(a, "wanted", evict=True)
            if why:
                waiting[a] = why
    # A hot adapter: one more replica per pass; a cooled one gives back a copy.
    for a in by_demand:
        holders = b.holders(a)
        d = b.inputs.demand.get(a, 0)
        if holders and d / len(holders) > hot:
            b.give(a, f"{d} requests over {len(holders)} replica(s), above {hot:g} each", evict=False)
        elif len(holders) > 1 and d <= hot * (len(holders) - 1) / 2:
            extra = [
                rid
                for rid in holders
                if not b.busy(rid, a) and now - b.asked_at(rid, a) >= policy.min_residency_s
            ]
            if extra:
                rid = max(extra, key=lambda r: (b.asked_at(r, a), r))
                b.unload(rid, a, f"{d} requests fit {len(holders) - 1} replica(s)")
    # Used lately but on no running replica (its replica went away): given again where a slot is free.
    lost = {a for rid, names in memo.assigned.items() if rid not in {r.id for r in b.live} for a in names}
    for a in sorted(lost):
        if a in b.adapters and not b.holders(a) and now - b.used.get(a, 0.0) < policy.idle_s:
            b.give(a, "its replica went away", evict=False)
