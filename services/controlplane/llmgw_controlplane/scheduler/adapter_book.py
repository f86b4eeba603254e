"""The control plane's LoRA adapters across passes (issue 33): what agents report, what wakes asked for,
the last decision, and the answer to a wake for an adapter. Pure: time comes in as arguments.

One pass: :meth:`AdapterBook.decide` (:func:`adapters.decide_adapters` over the snapshot, the routers'
demand and the wakes) -> the assignment writer puts :meth:`AdapterBook.loads_for` on each replica's
shard 0. A wake for an adapter (``WakeRequest(model=<adapter>)``) is answered by
:func:`adapter_wake_answer`: ``serving`` when a replica that serves has it loaded, ``refused`` when its
base cannot come or its load failed on every replica that could load it, else ``waking``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from llmgw_common.catalog import AdapterProfile, Catalog
from llmgw_common.messages import AdapterLoad
from llmgw_common.router_messages import WakeReply, WakeState
from llmgw_controlplane.scheduler.adapter_reports import AdapterReports, AdapterSeen
from llmgw_controlplane.scheduler.adapters import (
    AdapterDecision,
    AdapterInputs,
    AdapterMemo,
    AdapterPolicy,
    adapter_loads,
    decide_adapters,
)
from llmgw_controlplane.scheduler.demand import Merged
from llmgw_controlplane.scheduler.phase import serving
from llmgw_controlplane.scheduler.snapshot import Snapshot

# A wake keeps its adapter wanted this long after the last ask (a holding router asks again).
WANT_S = 60.0


def adapter_demand(demand: Mapping[str, Merged], catalog: Catalog) -> dict[str, int]:
    """Adapter -> requests the routers hold, queue or have in flight for it."""
    return {a: m.in_flight + m.pending for a in catalog.adapter_names if (m := demand.get(a)) is not None}


def loaded_on(snap: Snapshot, seen: Mapping[str, AdapterSeen], adapter: str) -> list[str]:
    """Replicas that serve and whose fresh report lists ``adapter`` loaded."""
    return [r.id for r in snap.replicas if serving(snap, r) and adapter in seen.get(r.id, _NONE).loaded]


_NONE = AdapterSeen(node="", at=0.0)


def adapter_errors(snap: Snapshot, seen: Mapping[str, AdapterSeen], a: AdapterProfile) -> dict[str, str]:
    """Replica id -> why its last load of ``a`` failed, for the base's replicas that report one."""
    return {
        r.id: err
        for r in snap.replicas
        if r.model == a.base and (err := seen.get(r.id, _NONE).errors.get(a.name)) is not None
    }


def adapter_wake_answer(
    snap: Snapshot,
    a: AdapterProfile,
    seen: Mapping[str, AdapterSeen],
    base_reply: Callable[[], WakeReply],
) -> WakeReply:
    """What to tell a router holding a request for adapter ``a`` (pure but for ``base_reply``, the base's
    own wake, asked only when no replica of the base serves)."""
    if loaded_on(snap, seen, a.name):
        return WakeReply(model=a.name, state=WakeState.SERVING)
    base = snap.catalog.get(a.base)
    if base is None:  # a catalog refuses this; a hand-built one may not
        return WakeReply(
            model=a.name, state=WakeState.REFUSED, reason=f"its base {a.base} is not in the catalog"
        )
    mine = [r for r in snap.replicas if r.model == a.base and not r.draining]
    errors = adapter_errors(snap, seen, a)
    if mine and all(r.id in errors for r in mine):
        first = sorted(errors.items())[0]
        return WakeReply(
            model=a.name,
            state=WakeState.REFUSED,
            reason=f"adapter {a.name} could not be loaded on base {a.base}: {first[1]} (replica {first[0]})",
        )
    if not any(serving(snap, r) for r in mine):
        b = base_reply()
        if b.state is WakeState.REFUSED:
            return WakeReply(
                model=a.name, state=WakeState.REFUSED, reason=f"its base {a.base} cannot come: {b.reason}"
            )
        return WakeReply(model=a.name, state=WakeState.WAKING, reason=f"its base {a.base} is waking")
    return WakeReply(model=a.name, state=WakeState.WAKING, reason=f"loading on a replica of {a.base}")


def adapter_watch(
    snap: Snapshot, seen: Mapping[str, AdapterSeen]
) -> tuple[dict[str, int], dict[str, float], dict[str, str]]:
    """For watched adapters, what :func:`event_detection.watch_inputs` gives for models: the replicas of
    its base that serve and could serve it (its load did not fail there), its budget, and why it has
    none. An adapter loaded nowhere is not down: its next request loads it."""
    ready: dict[str, int] = {}
    budgets: dict[str, float] = {}
    why: dict[str, str] = {}
    for a in snap.catalog.adapters:
        if a.watch is None:
            continue
        budgets[a.name] = a.watch.budget
        errors = adapter_errors(snap, seen, a)
        n = sum(1 for r in snap.replicas if r.model == a.base and serving(snap, r) and r.id not in errors)
        if n:
            ready[a.name] = n
        elif errors:
            rid, err = sorted(errors.items())[0]
            why[a.name] = f"adapter {a.name} could not be loaded on base {a.base}: {err} (replica {rid})"
        else:
            why[a.name] = f"its base {a.base} has no ready replica"
    return ready, budgets, why


class AdapterBook:
    """Adapters across passes: reports, wakes, the memo and the last decision."""

    def __init__(self, reports: AdapterReports | None = None, policy: AdapterPolicy | None = None) -> None:
        self.reports = reports if reports is not None else AdapterReports()
        self.policy = policy or AdapterPolicy()
        # adapter -> the latest wake for it
        self.wants: dict[str, float] = {}
        self.memo: AdapterMemo | None = None
        self.last: AdapterDecision | None = None
        # adapter -> the routers' arrivals over their window, as last seen: a rise is a request since
        self._arrived: dict[str, int] = {}

    def new_tenure(self) -> None:
        """Leading (again): the memo is rebuilt from the stored assignments on the first pass."""
        self.wants.clear()
        self._arrived.clear()
        self.memo = None
        self.last = None

    def seen(self, snap: Snapshot) -> Mapping[str, AdapterSeen]:
        """The fresh reports of replicas in ``snap`` sent by the node that runs their shard 0: a node
        speaks for its own replicas only (its subject's permissions prove the sender, not the replica)."""
        owner = {r.id: r.shards[0].node for r in snap.replicas if r.shards}
        return {rid: s for rid, s in self.reports.seen(snap.now).items() if owner.get(rid) == s.node}

    def ask(self, adapter: str, now: float) -> None:
        self.wants[adapter] = max(now, self.wants.get(adapter, now))

    def wanted(self, now: float) -> frozenset[str]:
        for a in [a for a, t in self.wants.items() if now - t >= WANT_S]:
            del self.wants[a]
        return frozenset(self.wants)

    def decide(
        self,
        snap: Snapshot,
        demand: Mapping[str, Merged],
        written: Callable[[], Mapping[str, tuple[str, ...]]],
    ) -> AdapterDecision:
        """One pass's decision; ``written``: replica -> adapters of the stored assignments (a new
        tenure's starting point, read only then)."""
        memo = self.memo if self.memo is not None else AdapterMemo.from_assignments(written(), snap.now)
        arrived = {a: m.arrived for a in snap.catalog.adapter_names if (m := demand.get(a)) is not None}
        touched = frozenset(a for a, n in arrived.items() if n > self._arrived.get(a, 0))
        self._arrived = arrived
        inputs = AdapterInputs(
            seen=self.seen(snap),
            demand=MappingProxyType(adapter_demand(demand, snap.catalog)),
            wanted=self.wanted(snap.now),
            touched=touched,
        )
        d = decide_adapters(snap, memo, inputs, self.policy)
        self.memo, self.last = d.memo, d
        # A wake served by a load: the adapter stays wanted while requests for it are reported.
        for a in list(self.wants):
            if loaded_on(snap, inputs.seen, a):
                del self.wants[a]
        return d

    def loads_for(self, catalog: Catalog) -> dict[str, tuple[AdapterLoad, ...]]:
        """Replica id -> what its shard 0 assignment carries."""
        if self.last is None:
            return {}
        by_name = {a.name: a for a in catalog.adapters}
        return {rid: adapter_loads(by_name, names) for rid, names in self.last.assigned.items()}

    def answer(self, snap: Snapshot, a: AdapterProfile, base_reply: Callable[[], WakeReply]) -> WakeReply:
        reply = adapter_wake_answer(snap, a, self.seen(snap), base_reply)
        if reply.state is WakeState.WAKING:
            self.ask(a.name, snap.now)
        return reply
