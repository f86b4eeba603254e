"""Events for people, published into stream ``LLMGW_EVENTS`` (the I/O). They are detected in
:mod:`event_detection` (pure), :mod:`announcements` and :mod:`autoscale`; each event's id doubles as the
``Nats-Msg-Id`` so a retried publish is stored once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

import nats.errors
from nats.js import JetStreamContext

from llmgw_common.codec import encode
from llmgw_common.messages import Event
from llmgw_common.subjects import Subjects

log = logging.getLogger("llmgw.controlplane.events")


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
