"""Events for people: detected from state transitions (pure), published into stream ``LLMGW_EVENTS``.

Kinds: ``node.lost``, ``node.recovered``, ``model.down`` / ``model.recovered`` (catalog models with
``watch``), ``placement.failing`` (a model unplaceable for longer than a threshold). Each event's id
is derived from what it is about and when it happened, and doubles as the ``Nats-Msg-Id`` so a retried
publish is stored once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping

import nats.errors
from nats.js import JetStreamContext

from llmgw_common.codec import encode
from llmgw_common.messages import Event
from llmgw_common.subjects import Subjects
from llmgw_controlplane.snapshot import NodeState
from llmgw_controlplane.state import Transition

log = logging.getLogger("llmgw.controlplane.events")

NODE_LOST = "node.lost"
NODE_RECOVERED = "node.recovered"
MODEL_DOWN = "model.down"
MODEL_RECOVERED = "model.recovered"
PLACEMENT_FAILING = "placement.failing"


def _event(kind: str, subject: str, now: float, summary: str, **details: object) -> Event:
    return Event(
        id=f"{kind}:{subject}:{int(now * 1000)}",
        kind=kind,
        subject=subject,
        time=now,
        summary=summary,
        details=dict(details),
    )


class EventDetector:
    """Remembers what was last said about each node and model, and says only what changed."""

    def __init__(self, placement_failing_after_s: float) -> None:
        self.failing_after_s = placement_failing_after_s
        self.lost: set[str] = set()
        self.down: set[str] = set()
        self._had_ready: set[str] = set()
        self._unplaceable_since: dict[str, float] = {}
        self._failing_said: set[str] = set()

    def nodes(self, transitions: Iterable[Transition], now: float) -> list[Event]:
        out = []
        for t in transitions:
            if t.new is NodeState.LOST and t.node not in self.lost:
                self.lost.add(t.node)
                out.append(
                    _event(NODE_LOST, t.node, now, f"node {t.node} stopped reporting: its replicas move")
                )
            elif t.new is not NodeState.LOST and t.node in self.lost:
                self.lost.discard(t.node)
                out.append(_event(NODE_RECOVERED, t.node, now, f"node {t.node} reports again"))
        return out

    def forget_node(self, node: str) -> None:
        """The node left the table: if it ever reports again it is a new node, not a recovery."""
        self.lost.discard(node)

    def models(
        self, ready: Mapping[str, int], watched: Iterable[str], why: Mapping[str, str], now: float
    ) -> list[Event]:
        """``ready``: ready replicas per catalog model; ``why``: the routing reason for those without."""
        out = []
        watched = set(watched)
        for m in watched:
            n = ready.get(m, 0)
            if n > 0:
                self._had_ready.add(m)
                if m in self.down:
                    self.down.discard(m)
                    out.append(_event(MODEL_RECOVERED, m, now, f"model {m} has {n} ready replica(s) again"))
            elif m in self._had_ready and m not in self.down:
                self.down.add(m)
                reason = why.get(m, "no ready replica")
                out.append(
                    _event(MODEL_DOWN, m, now, f"model {m} has no ready replica: {reason}", reason=reason)
                )
        # A model no longer watched (or no longer in the catalog) is forgotten.
        self._had_ready &= watched
        self.down &= watched
        return out

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
                        PLACEMENT_FAILING,
                        m,
                        now,
                        f"model {m} cannot be placed: {reason}",
                        reason=reason,
                        since=since,
                    )
                )
        return out

    def unplaceable_since(self, model: str) -> float | None:
        return self._unplaceable_since.get(model)


class EventPublisher:
    """Publishes events; one that fails stays queued and is retried next pass (its id dedupes).

    Every event is published while the stream takes them, however many a pass produced (a mass node
    loss makes thousands): the queue is bounded only while the stream cannot be reached, and then the
    oldest beyond ``MAX_PENDING`` go, said in one line.
    """

    MAX_PENDING = 1000

    def __init__(self, js: JetStreamContext, subjects: Subjects) -> None:
        self.js = js
        self.subjects = subjects
        self.published = 0
        self.dropped = 0
        self.pending: deque[Event] = deque()

    async def publish(self, events: Iterable[Event]) -> None:
        for ev in events:
            log.info("event %s: %s", ev.kind, ev.summary)
            self.pending.append(ev)
        while self.pending:
            ev = self.pending[0]
            try:
                await self.js.publish(
                    self.subjects.event(ev.kind), encode(ev), headers={"Nats-Msg-Id": ev.id}, timeout=2.0
                )
            except (nats.errors.Error, TimeoutError) as e:
                log.warning("could not publish event %s yet (%d queued): %s", ev.id, len(self.pending), e)
                self._bound()
                return
            self.pending.popleft()
            self.published += 1

    def _bound(self) -> None:
        """The stream is unreachable: keep the newest ``MAX_PENDING`` for the retry, say how many went."""
        over = len(self.pending) - self.MAX_PENDING
        if over <= 0:
            return
        for _ in range(over):
            self.pending.popleft()
        self.dropped += over
        log.error(
            "event stream unreachable: %d oldest events dropped (%d kept for retry)", over, len(self.pending)
        )
