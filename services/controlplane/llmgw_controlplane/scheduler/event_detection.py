"""Events for people, detected from state transitions (pure; :mod:`events` publishes them into stream
``LLMGW_EVENTS``).

Kinds: ``model.down`` / ``model.recovered`` (catalog models with ``watch``: down once without a ready
replica for the watch's budget), ``placement.failing`` (a model unplaceable for longer than a
threshold). ``node.lost`` / ``node.recovered`` are made in :mod:`announcements`, from the cluster's
announced state rather than this process's memory; scaling's kinds (``model.scaled_to_zero``,
``model.woken``, ``model.evicted``, ``model.scaled_up``/``down``) in :mod:`autoscale`. Each event's id
is derived from what it is about and when it happened, and doubles as the ``Nats-Msg-Id`` so a retried
publish is stored once.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw_common.event_details import (
    EventDetails,
    ModelDownDetails,
    ModelRecoveredDetails,
    NodeLostDetails,
    NodeRecoveredDetails,
    PlacementFailingDetails,
    event,
)
from llmgw_common.messages import Event
from llmgw_controlplane.scheduler.phase import serving
from llmgw_controlplane.scheduler.snapshot import NodeState, Snapshot

NODE_LOST = NodeLostDetails.KIND
NODE_RECOVERED = NodeRecoveredDetails.KIND
MODEL_DOWN = ModelDownDetails.KIND
MODEL_RECOVERED = ModelRecoveredDetails.KIND
PLACEMENT_FAILING = PlacementFailingDetails.KIND
# Every kind this module emits.
KINDS = (NODE_LOST, NODE_RECOVERED, MODEL_DOWN, MODEL_RECOVERED, PLACEMENT_FAILING)


def _event(subject: str, now: float, summary: str, details: EventDetails) -> Event:
    return event(
        details, id=f"{details.KIND}:{subject}:{int(now * 1000)}", subject=subject, time=now, summary=summary
    )


def watch_inputs(snap: Snapshot) -> tuple[dict[str, int], dict[str, float], dict[str, str]]:
    """What :meth:`EventDetector.models` needs from a snapshot: ready replicas per watched model, each
    watched model's budget, and why, for those whose only serving replicas are on silent nodes.

    A replica counts only while every node it runs on reports (READY). Routers keep using a replica on
    an unreachable node (it may well serve), but nobody knows that it does: counting it would hold the
    alert off until the node is lost (30 s by default) and then for the budget again.
    """
    budgets = {p.name: p.watch.budget for p in snap.catalog.models if p.watch is not None}
    ready: dict[str, int] = {}
    silent: dict[str, set[str]] = {}
    for r in snap.replicas:
        if r.model not in budgets or not serving(snap, r):
            continue
        quiet = {s.node for s in r.shards if snap.nodes[s.node].state is not NodeState.READY}
        if quiet:
            silent.setdefault(r.model, set()).update(quiet)
        else:
            ready[r.model] = ready.get(r.model, 0) + 1
    why = {
        m: f"no ready replica known: its replicas are on nodes that stopped reporting ({', '.join(sorted(ns))})"
        for m, ns in silent.items()
        if m not in ready
    }
    return ready, budgets, why


class EventDetector:
    """Remembers what was last said about each node and model, and says only what changed."""

    def __init__(self, placement_failing_after_s: float) -> None:
        self.failing_after_s = placement_failing_after_s
        # Watched model -> the last pass that saw it with a ready replica, and, while it is down,
        # that time again (the outage's start).
        self._last_ready: dict[str, float] = {}
        self._down_since: dict[str, float] = {}
        self._unplaceable_since: dict[str, float] = {}
        self._failing_said: set[str] = set()

    def new_tenure(self) -> None:
        """Leading (again): forget what was judged of models in an earlier tenure. Meanwhile another
        leader watched them and said what there was to say; when a model last had a ready replica, or
        since when it was unplaceable, is known again only from this tenure's own passes."""
        self._last_ready.clear()
        self._down_since.clear()
        self._unplaceable_since.clear()
        self._failing_said.clear()

    def models(
        self, ready: Mapping[str, int], watched: Mapping[str, float], why: Mapping[str, str], now: float
    ) -> list[Event]:
        """``ready``: ready replicas per catalog model; ``watched``: each watched model's budget (s);
        ``why``: the routing reason for those without. Call it every pass: time alone makes a model down.

        A watched model is down once it has had no ready replica for its budget, counted on our clock
        from the last pass that saw one (a replica that comes back sooner was a blip, not an outage);
        a model never seen ready since we lead (or since it became watched) is starting, not down.
        """
        out = []
        for m, budget in watched.items():
            n = ready.get(m, 0)
            if n > 0:
                self._last_ready[m] = now
                if m in self._down_since:
                    since = self._down_since.pop(m)
                    out.append(
                        _event(
                            m,
                            now,
                            f"model {m} has {n} ready replica(s) again, after {now - since:.0f}s without",
                            ModelRecoveredDetails(since=since),
                        )
                    )
                continue
            last = self._last_ready.get(m)
            if last is None or m in self._down_since or now - last < budget:
                continue
            self._down_since[m] = last
            reason = why.get(m, "no ready replica")
            out.append(
                _event(
                    m,
                    now,
                    f"model {m} has had no ready replica for {now - last:.0f}s (budget {budget:g}s): {reason}",
                    ModelDownDetails(reason=reason, since=last, budget=budget),
                )
            )
        # A model no longer watched (or no longer in the catalog) is forgotten.
        for table in (self._last_ready, self._down_since):
            for m in set(table) - set(watched):
                del table[m]
        return out

    @property
    def down(self) -> set[str]:
        """Watched models said down and not yet recovered."""
        return set(self._down_since)

    def placement(self, unplaceable: Mapping[str, str], now: float) -> list[Event]:
        out = []
        for m in list(self._unplaceable_since):
            if m not in unplaceable:
                del self._unplaceable_since[m]
                self._failing_said.discard(m)
        for m, reason in unplaceable.items():
            since = self._unplaceable_since.setdefault(m, now)
            if now - since >= self.failing_after_s and m not in self._failing_said:
                self._failing_said.add(m)
                out.append(
                    _event(
                        m,
                        now,
                        f"model {m} cannot be placed: {reason}",
                        PlacementFailingDetails(reason=reason, since=since),
                    )
                )
        return out

    def unplaceable_since(self, model: str) -> float | None:
        return self._unplaceable_since.get(model)
