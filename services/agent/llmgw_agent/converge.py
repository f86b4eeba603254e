"""What the agent must do to make its engines match its assignment: a pure function over snapshots.

Shards are compared by the fingerprint of their *assignment*, not of the command line the agent
derived from it: a running engine is never restarted because something on the node changed (weights
appearing in a model directory, a newer agent building its flags differently). Rules:

- A shard assigned and running from the same assignment is left alone, whatever its state: a failed
  shard stays failed until its assignment changes (the control plane decides about retries, with
  backoff; the agent never crash-loops an engine on its own).
- A shard whose assignment changed is stopped and started again.
- A shard this node refuses is recorded failed with the reason; the reason is re-evaluated on every
  pass, so a refusal that no longer holds (the weights arrived) turns into a start.
- An engine of a previous agent run that is still alive is adopted when it is still assigned with the
  same assignment, and stopped otherwise.
- Everything running and not assigned is stopped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw_agent.engines import LaunchSpec, Refusal
from llmgw_common.messages import ShardAssignment

ShardKey = tuple[str, int]


# Fields added to ShardAssignment after engines were running: left out of the fingerprint while at their
# default, so an upgrade of the agent or the control plane restarts no engine.
_LATER_FIELDS = ("cache_routing", "max_loras", "max_lora_rank", "max_cpu_loras")
# Fields the agent converges to on a running engine, never by restarting it: a replica's LoRA adapters
# are loaded and unloaded through the engine's runtime API (issue 33).
_LIVE_FIELDS = frozenset({"adapters"})


def assignment_fingerprint(a: ShardAssignment) -> str:
    """A short hash of everything the control plane asked of this shard that its engine is started with."""
    leave_out = _LIVE_FIELDS | {f for f in _LATER_FIELDS if getattr(a, f) is None}
    return hashlib.sha256(a.model_dump_json(exclude=set(leave_out)).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Wanted:
    """One assigned shard: its assignment's fingerprint and what this node would run for it."""

    fingerprint: str
    spec: LaunchSpec | Refusal


@dataclass(frozen=True, slots=True)
class Running:
    """What the supervisor holds for one shard."""

    fingerprint: str
    # The refusal reason when this node refused the shard (nothing runs); None for an engine.
    refused: str | None = None


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
    wanted: Mapping[ShardKey, Wanted],
    running: Mapping[ShardKey, Running],
    adoptable: Mapping[ShardKey, str],
) -> Plan:
    """``adoptable``: engines of a previous run still alive, key -> their assignment fingerprint."""
    plan = Plan()
    for key in sorted(running):
        if key not in wanted:
            plan.stop.append(key)
    for key in sorted(adoptable):
        w = wanted.get(key)
        if key in running or w is None or isinstance(w.spec, Refusal) or w.fingerprint != adoptable[key]:
            plan.stop_orphans.append(key)
    for key in sorted(wanted):
        w = wanted[key]
        have = running.get(key)
        if have is not None and have.refused is None and have.fingerprint == w.fingerprint:
            continue  # the engine of this very assignment: left alone, ready or failed
        if isinstance(w.spec, Refusal):
            if have is not None and have.refused == w.spec.reason:
                continue
            if have is not None:
                plan.stop.append(key)
            plan.refuse.append(key)
            continue
        if have is not None:
            plan.stop.append(key)
            plan.start.append(key)
        elif adoptable.get(key) == w.fingerprint:
            plan.adopt.append(key)
        else:
            plan.start.append(key)
    return plan
