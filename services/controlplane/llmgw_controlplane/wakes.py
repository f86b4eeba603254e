"""Wake requests (issue 13): a router holds a request for a model with no replica and asks the leading
control plane, on ``<prefix>.router.<id>.wake``, to bring one.

- :class:`WakeBook` remembers the wakes: per model the first unanswered one (the cold start is measured
  from it to the first ready replica) and the latest (the model's wake window: it keeps its replicas
  for ``idle_after`` from there). Asking again for a model already waking changes nothing but the
  window, so concurrent wakes for one model place one replica set.
- :func:`wake_answer` (pure) decides the reply: ``serving`` when a replica serves already, ``refused``
  with placement's reason when nothing can come (not in the catalog, 0 replicas asked, crash-loop
  backoff, no room even were every replica that may ever be evicted stopped), else ``waking`` (also
  while the room is blocked only for now: a replica too young to evict, a wake on its way).
- :class:`WakeResponder` is the I/O: subscribed only while this process leads (a standby never
  answers), it answers, records the wake and wakes the reconcile loop. One model's answer is reused
  for a second while the tables are unchanged: a flood of wakes costs one placement search per model,
  not one per message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from llmgw_common import bus
from llmgw_common.catalog import Catalog
from llmgw_common.codec import encode
from llmgw_common.messages import WakeReply, WakeRequest, WakeState
from llmgw_common.names import check_model_name, clipped
from llmgw_controlplane.eviction import plan_eviction, room_ever
from llmgw_controlplane.placement import Unplaceable, place
from llmgw_controlplane.routing import serving
from llmgw_controlplane.scaling import IdleLookup
from llmgw_controlplane.snapshot import Snapshot

log = logging.getLogger("llmgw.controlplane.wakes")

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


# One model's answer is reused this long while the control plane's tables (``version``) are unchanged.
# An answer for a model that does not fit searches placements: ~80 ms on 64 nodes of 8 cards
# (a catalog of 512 one-card models, all resident and evictable, and one 8-card model woken). Computed
# per message, a few dozen wakes a second (routers re-asking, or any process with the router role)
# would hold the event loop, lease renewal and reconcile pass included; reused, a flood costs one
# search per model per interval.
ANSWER_REUSE_S = 1.0
# Answers kept at most (then all are dropped): wakes for invented model names must not grow memory.
MEMO_MAX = 1024


class WakeResponder:
    """Answers wake requests while this process leads. ``answer(request)`` is the control plane's (it
    reads its tables and records the wake); ``version()`` changes whenever those tables do."""

    def __init__(
        self,
        subject: str,
        answer: Callable[[WakeRequest], WakeReply],
        drops: bus.DropLog,
        *,
        version: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
        reuse_s: float = ANSWER_REUSE_S,
    ) -> None:
        self.subject = subject
        self.answer = answer
        self.drops = drops
        self.version = version
        self.clock = clock
        self.reuse_s = reuse_s
        self._sub: Subscription | None = None
        # model -> (tables' version, when computed, the answer)
        self._memo: dict[str, tuple[int, float, WakeReply]] = {}
        self.answered = 0

    async def start(self, nc: NATS) -> None:
        if self._sub is None:
            self._sub = await bus.subscribe(nc, self.subject, WakeRequest, self._on_wake, self.drops)
            await bus.sent(nc)

    async def stop(self) -> None:
        self._memo.clear()  # a later tenure answers from its own tables
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error as e:
                log.debug("wake responder stop: %s", e)

    def _reply(self, req: WakeRequest) -> WakeReply:
        """The answer for ``req.model``: the one computed last while the tables are unchanged and it is
        recent, else a new one (which the control plane records: a reused ``waking`` was recorded)."""
        try:
            check_model_name(req.model)
        except ValueError as e:
            # No catalog has it. Echoed in full, a name near the payload limit makes the reply too big
            # to send (the router would wait out its timeout), and would be kept in the memo.
            return WakeReply(
                model=clipped(req.model, 100), state=WakeState.REFUSED, reason=f"not a model name: {e}"
            )
        version, now = self.version(), self.clock()
        hit = self._memo.get(req.model)
        if hit is not None and hit[0] == version and now - hit[1] < self.reuse_s:
            return hit[2]
        reply = self.answer(req)
        if len(self._memo) >= MEMO_MAX:
            self._memo.clear()
        # The version after: computing it took a snapshot, which may have counted pending changes.
        self._memo[req.model] = (self.version(), now, reply)
        return reply

    async def _on_wake(self, req: WakeRequest, msg: Msg) -> None:
        parts = msg.subject.split(".")
        if len(parts) < 2 or parts[-2] != req.router:
            # Permissions are per subject: only the subject's router is believed.
            self.drops.drop(msg.subject, f"claims router {req.router!r}, not the subject's")
            return
        if not msg.reply:
            return
        reply = self._reply(req)
        self.answered += 1
        try:
            await msg.respond(encode(reply))
        except nats.errors.Error as e:
            log.warning("could not answer a wake for %s: %s", req.model, e)
