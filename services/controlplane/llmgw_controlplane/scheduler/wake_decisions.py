"""Wake decisions (issue 13), pure: a router holds a request for a model with no replica and asks the
leading control plane to bring one; what is remembered of the wakes and what to answer.

- :class:`WakeBook` remembers the wakes: per model the first unanswered one (the cold start is measured
  from it to the first ready replica) and the latest (the model's wake window: it keeps its replicas
  for ``idle_after`` from there). Asking again for a model already waking changes nothing but the
  window, so concurrent wakes for one model place one replica set.
- :func:`wake_answer` decides the reply: ``serving`` when a replica serves already, ``refused`` with
  placement's reason when nothing can come (not in the catalog, 0 replicas asked, crash-loop backoff,
  no room even were every replica that may ever be evicted stopped), else ``waking`` (also while the
  room is blocked only for now: a replica too young to evict, a wake on its way).

The I/O that answers routers on the bus is :mod:`wakes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from llmgw_common.catalog import Catalog
from llmgw_common.router_messages import WakeReply, WakeState
from llmgw_controlplane.scheduler.eviction import plan_eviction, room_ever
from llmgw_controlplane.scheduler.phase import serving
from llmgw_controlplane.scheduler.placement import Unplaceable, place
from llmgw_controlplane.scheduler.scaling import IdleLookup
from llmgw_controlplane.scheduler.snapshot import Snapshot

# A wake not served keeps its model wanted this long after the last ask (routers re-ask while they
# hold requests), however short the model's idle_after.
PENDING_WAKE_S = 600.0


class WakeBook:
    """Wakes asked for: pure bookkeeping, time as arguments."""

    def __init__(self) -> None:
        # model -> the first wake not yet served by a ready replica
        self.pending: dict[str, float] = {}
        # model -> the latest wake (its window)
        self.latest: dict[str, float] = {}
        # model -> the last cold start measured (wake to ready, seconds), and when it ended
        self.cold_starts: dict[str, tuple[float, float]] = {}

    def ask(self, model: str, now: float) -> bool:
        """Record a wake; True when the model was not waking already."""
        self.latest[model] = max(now, self.latest.get(model, now))
        if model in self.pending:
            return False
        self.pending[model] = now
        return True

    def forget(self, model: str) -> None:
        """The model's replica was evicted: its wake window is over."""
        self.latest.pop(model, None)
        self.pending.pop(model, None)

    def windows(self, catalog: Catalog, now: float) -> dict[str, float]:
        """Latest wake per model whose window (its ``idle_after``) is still open; others are forgotten."""
        out: dict[str, float] = {}
        for model, t in list(self.latest.items()):
            p = catalog.get(model)
            if p is None or p.idle_after is None:
                window = 0.0
            elif model in self.pending:
                # Not served yet (a start can outlast a short idle_after, or the control plane is
                # settling): wanted until served, or until nobody asked again for a while.
                window = max(p.idle_after, PENDING_WAKE_S)
            else:
                window = p.idle_after
            if now - t < window:
                out[model] = t
            else:
                del self.latest[model]
                self.pending.pop(model, None)
        return out

    def served(self, ready: AbstractSet[str], catalog: Catalog, now: float) -> list[tuple[str, float]]:
        """Models whose wake a ready replica now answers, with the cold start (seconds) of each."""
        done = []
        for model, t in list(self.pending.items()):
            if model in ready:
                del self.pending[model]
                # A pass's time is when it began: a wake taken while it wrote may look later than it.
                took = max(0.0, now - t)
                self.cold_starts[model] = (took, now)
                done.append((model, took))
            elif catalog.get(model) is None:
                del self.pending[model]
        names = set(catalog.names)
        for model in [m for m in self.cold_starts if m not in names]:
            del self.cold_starts[model]  # left the catalog: renamed models must not grow the book
        return done


def wake_answer(
    snap: Snapshot,
    model: str,
    idle: IdleLookup,
    *,
    min_residency_s: float,
    protected: AbstractSet[str],
    backoff: Mapping[str, str],
    settling: bool = False,
) -> WakeReply:
    """What to tell a router that asks for ``model`` (pure). ``settling``: the control plane has just
    started leading and waits for nodes to report: nothing can be judged unplaceable yet."""
    p = snap.catalog.get(model)
    if p is None:
        known = ", ".join(snap.catalog.names) or "none"
        return WakeReply(
            model=model,
            state=WakeState.REFUSED,
            reason=f"model {model} is not in the catalog (models: {known})",
        )
    if p.replicas == 0:
        return WakeReply(
            model=model, state=WakeState.REFUSED, reason="the catalog asks for 0 replicas of this model"
        )
    mine = [r for r in snap.replicas if r.model == model]
    if any(serving(snap, r) for r in mine):
        return WakeReply(model=model, state=WakeState.SERVING)
    if model in backoff:
        return WakeReply(model=model, state=WakeState.REFUSED, reason=backoff[model])
    if any(not r.draining for r in mine):
        return WakeReply(model=model, state=WakeState.WAKING)
    if settling:
        return WakeReply(model=model, state=WakeState.WAKING, reason="the control plane is starting")
    placed = place(p, snap)
    if not isinstance(placed, Unplaceable):
        return WakeReply(model=model, state=WakeState.WAKING)
    ev = plan_eviction(p, snap, idle, min_residency_s=min_residency_s, protected=protected)
    if ev.victims:
        return WakeReply(model=model, state=WakeState.WAKING, reason=ev.describe())
    never = room_ever(p, snap)
    if never is None:
        # Nothing may be evicted right now (too young, idleness not known yet, waking): the room comes.
        return WakeReply(model=model, state=WakeState.WAKING, reason=f"waiting for room: {ev.describe()}")
    return WakeReply(
        model=model,
        state=WakeState.REFUSED,
        reason=f"{never} (even with every replica that may be evicted stopped); {ev.describe()}",
    )
