"""Storm grouping: which held events go out now, and as which messages. Pure; time is a parameter.

A group opens with the first event of a kind and takes every later event of that kind whose own time
is within ``window`` of the opener's (event time, so that a backlog replayed after an outage groups
as it happened). A group is ready when the notifier has held its opener for ``window`` seconds, or
when it can take nothing more (a newer event of its kind fell outside it, or it is full). Groups go
out in the order of their openers, and only as a ready prefix, so a receiver never sees a later
group before an earlier one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmgw_common.messages import Event

# A message listing more subjects than this is split: receivers (Slack) cap a message's size.
MAX_GROUP = 100


@dataclass(frozen=True, slots=True)
class Held:
    """An event the notifier holds for one target: its stream sequence and when it was first seen."""

    seq: int
    event: Event
    seen_at: float


@dataclass(frozen=True, slots=True)
class Group:
    kind: str
    items: tuple[Held, ...]

    @property
    def events(self) -> tuple[Event, ...]:
        return tuple(h.event for h in self.items)

    @property
    def seqs(self) -> tuple[int, ...]:
        return tuple(h.seq for h in self.items)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    ready: tuple[Group, ...]
    # When the first group that is not ready will be (None: nothing is waiting).
    wake_at: float | None


def plan_groups(held: Sequence[Held], now: float, window: float, max_group: int = MAX_GROUP) -> GroupPlan:
    """Split ``held`` (any order; sorted here by sequence) into groups and say which may go now."""
    items = sorted(held, key=lambda h: h.seq)
    if window <= 0:
        return GroupPlan(tuple(Group(h.event.kind, (h,)) for h in items), None)
    groups: list[list[Held]] = []
    closed: list[bool] = []
    open_by_kind: dict[str, int] = {}
    for h in items:
        i = open_by_kind.get(h.event.kind)
        if i is not None:
            opener = groups[i][0]
            if h.event.time - opener.event.time <= window and len(groups[i]) < max_group:
                groups[i].append(h)
                continue
            closed[i] = True
        open_by_kind[h.event.kind] = len(groups)
        groups.append([h])
        closed.append(False)
    for i, g in enumerate(groups):
        if len(g) >= max_group:
            closed[i] = True
    ready: list[Group] = []
    for g, is_closed in zip(groups, closed, strict=True):
        due = g[0].seen_at + window
        if not is_closed and now < due:
            return GroupPlan(tuple(ready), due)
        ready.append(Group(g[0].event.kind, tuple(g)))
    return GroupPlan(tuple(ready), None)
