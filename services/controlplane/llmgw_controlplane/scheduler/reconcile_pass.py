"""The working state of one reconcile pass: what it classified, placed, stopped and remembers.

Shared by the stages of :func:`reconciler.reconcile` (classify, in :mod:`reconciler`; per model, in
:mod:`reconcile_model`). Lives for one call; the memo it started from is handed back in the plan.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from llmgw_controlplane.scheduler.placement import Fleet, Unplaceable
from llmgw_controlplane.scheduler.plan import Backoff, ModelMemo, NewReplica, ReconcileMemo, StopReplica
from llmgw_controlplane.scheduler.ports import ports_by_address
from llmgw_controlplane.scheduler.snapshot import ReplicaView, Snapshot

NewId = Callable[[str, int], str]

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def default_replica_id(model: str, now: float, seq: int) -> str:
    """``<model>-<ms since epoch, hex>-<seq>``: unique across restarts, safe as a KV key and subject token."""
    return f"{_ID_UNSAFE.sub('_', model)}-{int(now * 1000):x}-{seq}"


@dataclass(slots=True)
class Active:
    replica: ReplicaView
    ready: bool
    reachable: bool
    # Started with a spec that its model's profile no longer has: to be rolled.
    outdated: bool = False


@dataclass(slots=True)
class Draining:
    replica: ReplicaView
    ready: bool
    deadline: float
    # Drained because its profile changed (not its node): stopped only once a replacement serves.
    rolling: bool = False


class Pass:
    """The working state of one reconcile pass; lives for one call of :func:`reconciler.reconcile`."""

    def __init__(
        self,
        snap: Snapshot,
        memo: ReconcileMemo,
        new_id: NewId | None,
        ports: tuple[int, int],
        refresh_s: float,
        wanted: Mapping[str, int],
        stop_first: AbstractSet[str],
    ) -> None:
        self.snap = snap
        # Scaling (scaling.py): wanted counts that override a profile's replicas, and idle replicas to
        # stop before any other surplus.
        self.wanted = wanted
        self.stop_first = stop_first
        self.reasons_refresh_s = refresh_s
        self.memo = memo
        self.new_id = new_id
        self.port_lo, self.port_hi = ports
        self.models: dict[str, ModelMemo] = dict(memo.models)
        self.models_changed = False
        self.counted = set(memo.counted)
        self.seq = memo.seq
        self.ids: set[str] = set()
        self.place: list[NewReplica] = []
        self.stop: list[StopReplica] = []
        self.mark: list[str] = []
        self.unplaceable: dict[str, Unplaceable] = {}
        self.backoff: dict[str, Backoff] = {}
        self._fleet: Fleet | None = None
        self._ports: dict[str, set[int]] | None = None

    def fleet(self) -> Fleet:
        if self._fleet is None:
            self._fleet = Fleet(self.snap)
        return self._fleet

    def ports(self) -> dict[str, set[int]]:
        if self._ports is None:
            self._ports = ports_by_address(self.snap)
        return self._ports

    def set_model(self, name: str, m: ModelMemo) -> None:
        if self.models.get(name, ModelMemo()) != m:
            self.models[name] = m
            self.models_changed = True

    def mint_id(self, model: str) -> str:
        while True:
            seq = self.seq
            self.seq += 1
            rid = (self.new_id or _default_id(self.snap.now))(model, seq)
            if rid not in self.ids:
                self.ids.add(rid)
                return rid


def _default_id(now: float) -> NewId:
    return lambda model, seq: default_replica_id(model, now, seq)
