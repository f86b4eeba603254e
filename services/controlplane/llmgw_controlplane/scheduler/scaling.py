"""Scaling down to ``min_replicas`` and back up on a wake (issue 13): the replicas wanted per model.

Pure: a snapshot, what is known of each replica's idleness (:mod:`idle`), the models woken recently and
the previous :class:`ScaleMemo` in; a :class:`ScaleDecision` out, which the reconciler reads as each
scaling model's wanted count. Only models whose catalog profile :attr:`~ModelProfile.scales` or
:attr:`~ModelProfile.follows_load` appear; :mod:`loadscale` then moves the latter with their load.

- A model's *target* starts (first pass of this process, or a model new to scaling) at what runs,
  between its floor and its ``replicas``: a fresh control plane neither stops nor starts anything.
  After that it moves only by this module: down by one per replica *known* idle for ``idle_after``
  (ARCHITECTURE #1: unknown is never idle, so with no router reporting nothing scales down), never
  below the floor; up to ``replicas`` on a wake. A replica that crashed is replaced, not scaled away.
- A woken model keeps its target while its wake window is open (``idle_after`` from the wake, longer
  while the wake is not served yet), whatever the idle bounds say: its new replica was used by nobody
  yet, the request that woke it may still be waiting for it.
- The replicas found idle are named in ``stop_first`` so that the reconciler stops those and not the
  busiest; ``to_zero`` names the models that reached 0 in this pass (event ``model.scaled_to_zero``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.idle import IdleKnowledge
from llmgw_controlplane.scheduler.snapshot import ReplicaView, Snapshot

# (replica id, created) -> what is known of its idleness at the snapshot's time.
IdleLookup = Callable[[str, float], IdleKnowledge]


def _empty() -> Mapping[str, int]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ScaleMemo:
    """Each scaling model's current target; carried from one pass to the next by the caller."""

    targets: Mapping[str, int] = field(default_factory=_empty)


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    wanted: Mapping[str, int]
    # Replicas known idle past their model's idle_after: the surplus the reconciler stops first.
    stop_first: frozenset[str]
    # Models whose target reached 0 in this pass, and every model at 0 (cold).
    to_zero: tuple[str, ...]
    cold: tuple[str, ...]
    memo: ScaleMemo


def _live(replicas: list[ReplicaView]) -> list[ReplicaView]:
    # Draining replicas are on their way out (a roll, a node drain): their replacements count instead.
    return [r for r in replicas if not r.draining]


def decide(snap: Snapshot, idle: IdleLookup, wakes: Mapping[str, float], memo: ScaleMemo) -> ScaleDecision:
    """The wanted replica count of every scaling model. ``wakes``: the models whose wake window is open
    (model -> its latest wake; :meth:`WakeBook.windows` decides how long a window lasts)."""
    by_model: dict[str, list[ReplicaView]] = {}
    for r in snap.replicas:
        by_model.setdefault(r.model, []).append(r)
    targets: dict[str, int] = {}
    stop_first: set[str] = set()
    to_zero: list[str] = []
    for p in snap.catalog.models:
        if not (p.scales or p.follows_load):
            continue
        live = _live(by_model.get(p.name, []))
        before = memo.targets.get(p.name)
        target = _clamp(len(live) if before is None else before, p)
        if p.name in wakes:
            # A load that asked for more while the window is open keeps them (loadscale.py).
            target = max(target, p.replicas)
        elif p.idle_after is not None:
            target, idle_ones = _scale_down(p, live, idle, target)
            stop_first.update(idle_ones)
        targets[p.name] = target
        if target == 0 and before is not None and before > 0:
            to_zero.append(p.name)
    return ScaleDecision(
        wanted=MappingProxyType(dict(targets)),
        stop_first=frozenset(stop_first),
        to_zero=tuple(to_zero),
        cold=tuple(m for m, t in targets.items() if t == 0),
        memo=memo if dict(memo.targets) == targets else ScaleMemo(MappingProxyType(targets)),
    )


def _clamp(n: int, p: ModelProfile) -> int:
    # The ceiling is ``replicas`` unless the model follows load up to ``max_replicas`` (issue 21).
    return max(p.floor, min(n, p.ceiling))


def _scale_down(
    p: ModelProfile, live: list[ReplicaView], idle: IdleLookup, target: int
) -> tuple[int, list[str]]:
    """The target lowered by one per replica known idle past ``idle_after`` (the idlest first), never
    below the floor; and those replicas."""
    assert p.idle_after is not None
    # Idleness takes a load-following model down to its floor like any other; load itself stops at
    # one replica (loadscale.py).
    room = target - p.floor
    if room <= 0:
        return target, []
    found: list[tuple[float, str]] = []
    for r in live:
        k = idle(r.id, r.created)
        if k.at_least(p.idle_after):
            assert k.seconds is not None
            found.append((k.seconds, r.id))
    found.sort(key=lambda x: (-x[0], x[1]))
    chosen = [rid for _, rid in found[:room]]
    return target - len(chosen), chosen
