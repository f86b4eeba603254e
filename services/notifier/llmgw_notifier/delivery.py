"""Delivery to one webhook target: its own durable consumer, retries, order, and acks after 2xx.

Each target has its own durable pull consumer on the events stream (``<prefix>-notifier-<hash of the
URL>``). JetStream therefore keeps, per event and per target, whether that target took it: a target
that is down holds back only its own events, and a notifier killed after Slack took an event but
before the JSON receiver did re-sends it to the JSON receiver only. An event is acknowledged on a
target's consumer only after that target answered 2xx (and the ack is flushed to the server before
the next event is sent, so a crash repeats at most the message that was in flight).

One worker per target sends one message at a time, in stream order: a receiver that was down for
five minutes gets everything afterwards, in order. Held events are kept alive with in-progress acks,
so only a dead notifier's events come back (after ``ack_wait_s``); after a restart, newer events wait
until those have come back, so order survives a crash too (``start_gate.py``).

A message that no retry delivered within ``retry_for_s`` (``posting.py``) is logged as an error, counted, and
terminated (``term``): blocking a target forever would hold back every later alert. An event no
message can be made of (``render`` fails) is terminated at once, likewise. The event stays in the
stream (bounded age) for anyone who wants to replay it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from fnmatch import fnmatchcase

import httpx
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from llmgw_common.codec import DecodeError, decode
from llmgw_common.event_details import parse_details
from llmgw_common.messages import Event, Webhook
from llmgw_common.subjects import Subjects
from llmgw_common.urls import shown_url
from llmgw_notifier.formats import Rendered, render
from llmgw_notifier.grouping import Group, Held, plan_groups
from llmgw_notifier.outages import KINDS as MERGED_KINDS
from llmgw_notifier.outages import OutageLedger
from llmgw_notifier.posting import post_until_taken
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.start_gate import StartGate
from llmgw_notifier.stats import NotifierStats
from llmgw_runtime.bus import DropLog, flush
from llmgw_runtime.runtime import cancel_and_wait

log = logging.getLogger("llmgw.notifier.delivery")

# Events fetched per pull; also the most a worker holds for grouping beyond what it is sending.
FETCH_BATCH = 256
MAX_ACK_PENDING = 10_000
# Longest wait for new events in one pull (shutdown cancels it; this only bounds a stale request).
IDLE_POLL_S = 5.0
# Sequences remembered as taken, so a redelivery of an event whose ack was lost is not re-sent.
DONE_MEMORY = 20_000


def consumer_name(prefix: str, target_id: str) -> str:
    return f"{prefix}-notifier-{target_id}"


def wants(hook: Webhook, kind: str) -> bool:
    """Whether ``hook`` takes events of ``kind``: no filter takes all; ``node.*`` style patterns work."""
    if hook.events is None:
        return True
    return any(fnmatchcase(kind, pattern) for pattern in hook.events)


class TargetWorker:
    """Delivers the events stream to one webhook, in order, acking each event after a 2xx."""

    def __init__(
        self,
        *,
        target_id: str,
        hook: Webhook,
        since: float,
        nc: NATS,
        js: JetStreamContext,
        subjects: Subjects,
        settings: NotifierSettings,
        http: httpx.AsyncClient,
        stats: NotifierStats,
        drops: DropLog,
        ledger: OutageLedger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target_id = target_id
        self.hook = hook  # replaced in place when the settings change (secret, filter, format)
        self.since = since
        self.nc = nc
        self.js = js
        self.subjects = subjects
        self.s = settings
        self.http = http
        self.stats = stats
        self.drops = drops
        self.ledger = ledger
        self.clock = clock
        self.name = consumer_name(subjects.prefix, target_id)
        self.held: dict[int, Held] = {}
        self.msgs: dict[int, Msg] = {}
        self._done: set[int] = set()
        self._done_order: deque[int] = deque()
        self._gate: StartGate | None = None

    # ------------------------------------------------------------ consumer

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.name,
            name=self.name,
            description=f"llmgw notifier: deliveries to {shown_url(self.hook.url)}",
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.fromtimestamp(self.since, UTC),  # type: ignore[arg-type]
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.s.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=MAX_ACK_PENDING,
            filter_subject=self.subjects.all_events(),
        )

    async def _bind(self) -> JetStreamContext.PullSubscription:
        return await self.js.pull_subscribe(
            self.subjects.all_events(),
            durable=self.name,
            stream=self.subjects.events_stream,
            config=self.consumer_config(),
        )

    # ------------------------------------------------------------ loop

    async def run(self) -> None:
        """Until cancelled: bind, pull, group, send, ack. NATS trouble rebinds after a pause."""
        keepalive = asyncio.create_task(self._keepalive(), name=f"notifier-keepalive-{self.target_id}")
        try:
            while True:
                try:
                    await self._session()
                except nats.errors.Error as e:
                    log.warning(
                        "target %s: bus trouble (%s: %s); rebinding in 1s",
                        shown_url(self.hook.url),
                        type(e).__name__,
                        e,
                    )
                    await asyncio.sleep(1.0)
        finally:
            try:
                # Not one cancel: an in-progress ack's publish can swallow it (see cancel_and_wait).
                await cancel_and_wait([keepalive])
            finally:
                await self._release()  # also when this stop is cancelled again meanwhile

    async def _session(self) -> None:
        sub = await self._bind()
        try:
            info = await sub.consumer_info()
            if self._gate is None:
                margin = max(2.0, self.s.ack_wait_s / 2)
                last = info.delivered.stream_seq if info.delivered else 0
                self._gate = StartGate(
                    last or 0, info.num_ack_pending or 0, self.clock() + self.s.ack_wait_s + margin, self.held
                )
                if not self._gate.is_open(self.clock()):
                    log.info(
                        "target %s: %d event(s) the previous notifier held come back within %.0fs; "
                        "newer ones wait for them",
                        shown_url(self.hook.url),
                        self._gate.outstanding,
                        self.s.ack_wait_s,
                    )
            while True:
                wake = await self._send_ready()
                timeout = IDLE_POLL_S if wake is None else min(IDLE_POLL_S, max(0.05, wake - self.clock()))
                try:
                    msgs = await sub.fetch(FETCH_BATCH, timeout=timeout)
                except TimeoutError:
                    continue
                for m in msgs:
                    await self._take(m)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _take(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if self._gate is not None:
            self._gate.saw(seq)
        if seq in self._done:
            # Taken before; its ack was lost. Confirm again, do not re-send.
            await msg.ack()
            return
        if seq in self.msgs:
            self.msgs[seq] = msg
            return
        try:
            event = decode(msg.data, Event)
            parse_details(event)  # known keys of the wrong type: dropped like any undecodable message
        except DecodeError as e:
            self.drops.drop(msg.subject, str(e))
            self.stats.undecodable_events += 1
            await msg.term()
            self._mark_done(seq)
            return
        if not wants(self.hook, event.kind):
            self.stats.filtered_events += 1
            await msg.ack()
            self._mark_done(seq)
            return
        if self.ledger is not None and event.kind in MERGED_KINDS:
            # One outage seen by two sources is one down and one recovery (see outages.py).
            verdict = await self.ledger.verdict(seq)
            if verdict is not None and not verdict.deliver:
                log.info("target %s: %s not sent: %s", shown_url(self.hook.url), event.id, verdict.reason)
                self.stats.merged_events += 1
                await msg.ack()
                self._mark_done(seq)
                return
            if verdict is not None:
                event = verdict.event
        self.held[seq] = Held(seq, event, self.clock())
        self.msgs[seq] = msg

    async def _send_ready(self) -> float | None:
        """Send every group that is ready, in order; the time the next one will be (None: none)."""
        now = self.clock()
        gate = self._gate
        held = [h for h in self.held.values() if gate is None or gate.admits(h.seq, now)]
        plan = plan_groups(held, now, self.s.group_window_s)
        for group in plan.ready:
            for part, rendered in self._rendered(group):
                if rendered is None:
                    for seq in part.seqs:
                        await self.msgs[seq].term()
                    self.stats.unrenderable_events += len(part.seqs)
                else:
                    await self._deliver(part, rendered)
                # The acks must reach the server before the next message goes out: a crash then repeats
                # only the message in flight. A failed flush leaves them buffered for the reconnect.
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await flush(self.nc, timeout=5)
                for seq in part.seqs:
                    self.held.pop(seq, None)
                    self.msgs.pop(seq, None)
                    self._mark_done(seq)
        if gate is not None and len(held) < len(self.held):
            # Some are held back by the gate: look again soon.
            nxt = min(gate.deadline, now + 0.5)
            return nxt if plan.wake_at is None else min(plan.wake_at, nxt)
        return plan.wake_at

    def _rendered(self, group: Group) -> list[tuple[Group, Rendered | None]]:
        """``group`` as one message; if it cannot be rendered, each of its events alone, and None for
        each that cannot be either (a forged time the clock cannot show, say). Such an event is a
        permanent failure: retrying renders it no better, and held first in line it would block every
        later event to this target."""
        try:
            return [(group, render(group.events, self.hook))]
        except Exception as e:
            if len(group.items) == 1:
                log.error(
                    "event %r cannot be rendered for %s (%s: %s); terminated, it stays in stream %s "
                    "until it ages out",
                    group.events[0].id,
                    shown_url(self.hook.url),
                    type(e).__name__,
                    e,
                    self.subjects.events_stream,
                )
                return [(group, None)]
        return [part for h in group.items for part in self._rendered(Group(group.kind, (h,)))]

    async def _deliver(self, group: Group, rendered: Rendered) -> None:
        """POST one message until taken or given up; ack (or terminate) its events accordingly."""
        outcome = await post_until_taken(self.http, self.hook.url, rendered, self.s, stats=self.stats)
        seqs = group.seqs
        if outcome.ok:
            for seq in seqs:
                await self.msgs[seq].ack()
            self.stats.delivered_events += len(seqs)
            self.stats.delivered_messages += 1
            now = self.clock()
            for h in group.items:
                self.stats.delivery_lag.observe(max(0.0, now - h.seen_at))
            self.stats.per_target[self.target_id] = self.stats.per_target.get(self.target_id, 0) + 1
            return
        log.error(
            "GAVE UP delivering %s (%d event(s): %s) to %s after %d attempts over %.0fs: %s; "
            "it stays in stream %s until it ages out",
            rendered.id,
            len(seqs),
            ", ".join(e.id for e in group.events[:10]),
            shown_url(self.hook.url),
            outcome.attempts,
            self.s.retry_for_s,
            outcome.last_error,
            self.subjects.events_stream,
        )
        for seq in seqs:
            await self.msgs[seq].term()
        self.stats.gave_up_events += len(seqs)

    def _mark_done(self, seq: int) -> None:
        self._done.add(seq)
        self._done_order.append(seq)
        while len(self._done_order) > DONE_MEMORY:
            self._done.discard(self._done_order.popleft())

    async def _keepalive(self) -> None:
        """Tell JetStream the held events are being worked on, so they are not redelivered."""
        period = max(0.2, self.s.ack_wait_s / 3)
        while True:
            await asyncio.sleep(period)
            for m in list(self.msgs.values()):
                with contextlib.suppress(nats.errors.Error):
                    await m.in_progress()

    async def _release(self) -> None:
        """On a clean stop, hand held events straight back (nak) so a restart need not wait for them."""
        for m in list(self.msgs.values()):
            with contextlib.suppress(nats.errors.Error):
                await m.nak()
        self.held.clear()
        self.msgs.clear()
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await flush(self.nc, timeout=2)
