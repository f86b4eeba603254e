"""Which LoRA adapters to load and unload on one engine: a pure function over what is wanted and what
the engine holds (issue 33).

The assignment's ``ShardAssignment.adapters`` is declarative, like the rest of it: what the engine
lists in ``/v1/models`` and the assignment does not ask for is unloaded; what it asks for and the
engine lacks is loaded, also after the engine restarted (it then lists none). An adapter loaded from
another path than the one wanted now is unloaded and loaded again. A load that failed is not tried
again at every pass: only once ``retry_s`` has passed, or when its path changed. An adapter that
cannot be loaded here at all (no weights on this node, a rank above the base's maximum) is not sent
to the engine; its reason is its error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class WantedAdapter:
    """One adapter the assignment asks for, as this node would load it."""

    name: str
    # Where the engine loads it from; None when it cannot be loaded here (``problem`` says why).
    path: str | None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """The last failed load of an adapter: from where, why (in the user's terms), and when."""

    path: str | None
    error: str
    at: float


@dataclass(slots=True)
class AdapterPlan:
    unload: list[str] = field(default_factory=list)
    # (name, path), in the assignment's order.
    load: list[tuple[str, str]] = field(default_factory=list)
    # Adapters refused here without asking the engine: name -> why.
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.unload or self.load or self.refused)


def plan_adapters(
    wanted: Sequence[WantedAdapter],
    loaded: Mapping[str, str],
    failures: Mapping[str, Failure],
    now: float,
    retry_s: float,
) -> AdapterPlan:
    """``loaded``: adapter name -> the path the engine loaded it from (its ``/v1/models`` ``root``)."""
    plan = AdapterPlan()
    by_name = {w.name: w for w in wanted}
    for name, path in loaded.items():
        w = by_name.get(name)
        if w is None or (w.path is not None and w.path != path):
            plan.unload.append(name)
    for w in wanted:
        if w.path is None:
            plan.refused[w.name] = w.problem or "cannot be loaded on this node"
            continue
        if loaded.get(w.name) == w.path:
            continue
        failed = failures.get(w.name)
        if failed is not None and failed.path == w.path and now - failed.at < retry_s:
            continue
        plan.load.append((w.name, w.path))
    return plan
