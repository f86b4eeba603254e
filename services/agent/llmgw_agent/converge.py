"""What the agent must do to make its engines match its assignment: a pure function over snapshots.

Rules:

- A shard assigned and running with the same launch fingerprint is left alone, whatever its state:
  a failed shard stays failed until its assignment changes (the control plane decides about retries,
  with backoff; the agent never crash-loops an engine on its own).
- A shard whose fingerprint changed is stopped and started again.
- A shard this node refuses is recorded failed with the reason (once, while the reason holds).
- An engine of a previous agent run that is still alive is adopted when it is still assigned with the
  same fingerprint, and stopped otherwise.
- Everything running and not assigned is stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw_agent.engines import LaunchSpec, Refusal

ShardKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Running:
    """What the supervisor holds for one shard: its fingerprint (None: refused) and error."""

    fingerprint: str | None
    error: str | None = None


@dataclass(slots=True)
class Plan:
    stop: list[ShardKey] = field(default_factory=list)
    stop_orphans: list[ShardKey] = field(default_factory=list)
    adopt: list[ShardKey] = field(default_factory=list)
    start: list[ShardKey] = field(default_factory=list)
    refuse: list[ShardKey] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.stop or self.stop_orphans or self.adopt or self.start or self.refuse)


def plan_converge(
    specs: Mapping[ShardKey, LaunchSpec | Refusal],
    running: Mapping[ShardKey, Running],
    adoptable: Mapping[ShardKey, str],
) -> Plan:
    """``specs``: the assigned shards' launch specs or refusals; ``adoptable``: key -> fingerprint."""
    plan = Plan()
    for key in sorted(running):
        if key not in specs:
            plan.stop.append(key)
    for key in sorted(adoptable):
        spec = specs.get(key)
        if key in running or not isinstance(spec, LaunchSpec) or spec.fingerprint != adoptable[key]:
            plan.stop_orphans.append(key)
    for key in sorted(specs):
        spec = specs[key]
        have = running.get(key)
        if isinstance(spec, Refusal):
            if have is not None and have.fingerprint is None and have.error == spec.reason:
                continue
            if have is not None:
                plan.stop.append(key)
            plan.refuse.append(key)
            continue
        if have is not None:
            if have.fingerprint == spec.fingerprint:
                continue
            plan.stop.append(key)
            plan.start.append(key)
        elif adoptable.get(key) == spec.fingerprint:
            plan.adopt.append(key)
        else:
            plan.start.append(key)
    return plan
