"""One outage, one ``model.down`` and one ``model.recovered``, whichever sources saw it.

Two sources say a watched model is down: the control plane ("no ready replica", no ``details.source``)
and the notifier's probes ("not answering", ``details.source == "probe"``). Each writes its own events,
with its own ids, into the events stream; sent as they are, one outage reaches an operator as two
downs and two recoveries that no receiver can dedupe. The notifier therefore merges them per model
before delivery:

- ``model.down`` is delivered when the first source says down (``details.sources`` names it); a down
  from another source during the same outage is acknowledged unsent.
- ``model.recovered`` is delivered when every source that said down has recovered, naming every source
  that reported the outage; earlier recoveries are acknowledged unsent. A probe's recovery is a real
  answer through a router, so it ends the outage by itself: a "no ready replica" claim still open at
  that point is stale (a control plane restarted mid-outage never says recovered), and its late
  recovery, if any, is dropped.
- A source that says down while its own earlier down is still open lost track of that outage (a
  restart, or the model left the watch list): both sources only say down again after they saw the
  model up, so the earlier outage ended unannounced and this is a new one; it is delivered.

Every verdict is a pure function of the ``model.*`` events before it in the stream, so every target
(each with its own consumer and place in the stream) and every restart reach the same verdicts. The
:class:`OutageLedger` folds the stream's ``model.*`` events in order, replaying them with
:func:`replay_events` at start and catching up on demand; the probes restore their own state from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pydantic import TypeAdapter, ValidationError

from llmgw_common.codec import DecodeError, decode
from llmgw_common.event_details import (
    DetailsError,
    ModelDownDetails,
    ModelRecoveredDetails,
    Timestamp,
)
from llmgw_common.messages import Event
from llmgw_common.subjects import Subjects
from llmgw_notifier.formats import utc

log = logging.getLogger("llmgw.notifier.outages")

DOWN = "model.down"
RECOVERED = "model.recovered"
KINDS = (DOWN, RECOVERED)
PROBE = "probe"
CONTROLPLANE = "controlplane"  # the control plane's events carry no ``source``
# Verdicts remembered by stream sequence (older ones are delivered as they are if ever redelivered).
VERDICT_MEMORY = 20_000
# Longest a delivery worker waits for the ledger before it sends an event unmerged.
VERDICT_TIMEOUT_S = 10.0


# ---------------------------------------------------------------- the decision (pure)


@dataclass(frozen=True, slots=True)
class Claim:
    source: str
    since: float
    event_id: str


@dataclass(frozen=True, slots=True)
class Outage:
    """A model's outage as the operator was told: the open claims and who reported it at all."""

    claims: tuple[Claim, ...]
    sources: tuple[str, ...]  # every source that said down during this outage, first first
    since: float
    announced: str  # the id of the model.down delivered for it


@dataclass(frozen=True, slots=True)
class OpenDown:
    """A source's ``model.down`` not yet followed by its recovery; ``said.since`` is set."""

    event: Event
    said: ModelDownDetails


@dataclass(frozen=True, slots=True)
class Verdict:
    deliver: bool
    event: Event  # as it is to be delivered (details name the sources); the original when dropped
    reason: str = ""


Said = ModelDownDetails | ModelRecoveredDetails
_TIMESTAMP: TypeAdapter[float] = TypeAdapter(Timestamp)


def said_of(ev: Event) -> Said:
    """What a ``model.down`` or ``model.recovered`` says, typed, with ``since`` always set (absent: the
    event's time). :class:`DetailsError` when its details do not fit, or when the outage's start would
    be a time no clock can show (a forged event time): the summaries name that start."""
    said: Said = ModelDownDetails.of(ev) if ev.kind == DOWN else ModelRecoveredDetails.of(ev)
    if said.since is not None:
        return said
    try:
        since = _TIMESTAMP.validate_python(ev.time)
    except ValidationError:
        raise DetailsError(
            f"{ev.kind} event {ev.id!r}: no details.since, and time {ev.time!r} cannot be shown"
        ) from None
    return said.model_copy(update={"since": since})


def source_of(said: Said) -> str:
    return said.source or CONTROLPLANE


def fold(outage: Outage | None, ev: Event) -> tuple[Outage | None, Verdict]:
    """The model's outage after ``ev`` (a ``model.down`` or ``model.recovered``) and what to do with it.
    One whose details do not fit is not sent and changes nothing."""
    if ev.kind not in KINDS:
        return outage, Verdict(True, ev)
    try:
        said = said_of(ev)
    except DetailsError as e:
        return outage, Verdict(False, ev, str(e))
    return _fold(outage, ev, said)


def _fold(outage: Outage | None, ev: Event, said: Said) -> tuple[Outage | None, Verdict]:
    src = source_of(said)
    open_sources = [c.source for c in outage.claims] if outage is not None else []
    if isinstance(said, ModelDownDetails):
        assert said.since is not None  # said_of sets it
        claim = Claim(src, said.since, ev.id)
        if outage is None or not outage.claims or src in open_sources:
            # The raw map keeps what a newer sender added; the merge's own keys are typed.
            merged_down = (
                ModelDownDetails(sources=(src,), previous_down=outage.announced)  # its end never reported
                if outage is not None and src in open_sources
                else ModelDownDetails(sources=(src,))
            )
            details = {**ev.details, **merged_down.wire()}
            new = Outage((claim,), (src,), claim.since, ev.id)
            return new, Verdict(True, ev.model_copy(update={"details": details}))
        sources = outage.sources if src in outage.sources else (*outage.sources, src)
        new = replace(outage, claims=(*outage.claims, claim), sources=sources)
        return new, Verdict(False, ev, f"already reported down by {', '.join(open_sources)}")
    if outage is None or src not in open_sources:
        return outage, Verdict(False, ev, f"no open model.down from {src}")
    left = () if src == PROBE else tuple(c for c in outage.claims if c.source != src)
    if left:
        still = ", ".join(c.source for c in left)
        return replace(outage, claims=left), Verdict(False, ev, f"still down according to {still}")
    merged = ModelRecoveredDetails(sources=outage.sources, down_since=outage.since, down_id=outage.announced)
    details = {**ev.details, **merged.wire()}
    cleared = tuple(s for s in open_sources if s != src)
    if cleared:
        # Claims a real answer outlived (their own recovery is dropped).
        details.update(ModelRecoveredDetails(cleared=cleared).wire())
    summary = (
        f"{ev.summary} (reported down by {' and '.join(outage.sources)} since {utc(outage.since)})"
        if ev.summary
        else ev.summary
    )
    return None, Verdict(True, ev.model_copy(update={"details": details, "summary": summary}))


# ---------------------------------------------------------------- reading the stream (I/O)


async def replay_events(
    js: JetStreamContext,
    subjects: Subjects,
    kinds: Iterable[str],
    on_msg: Callable[[int, bytes], None],
    start_seq: int = 0,
    fetch_timeout: float = 2.0,
) -> None:
    """Hand every event of ``kinds`` in the stream (from ``start_seq``; 0: all) to ``on_msg(seq, data)``
    in stream order, through a short-lived unacknowledged consumer, up to what was there when it began."""
    cfg = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_seq > 0 else DeliverPolicy.ALL,
        opt_start_seq=start_seq if start_seq > 0 else None,
        filter_subjects=[subjects.event(k) for k in kinds],
        inactive_threshold=30.0,
    )
    sub = await js.pull_subscribe("", stream=subjects.events_stream, config=cfg)
    try:
        pending = (await sub.consumer_info()).num_pending or 0
        while pending > 0:
            try:
                msgs = await sub.fetch(min(pending, 256), timeout=fetch_timeout)
            except TimeoutError:
                break
            pending -= len(msgs)
            for m in msgs:
                on_msg(m.metadata.sequence.stream, m.data)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await js.delete_consumer(subjects.events_stream, sub._consumer)


class OutageLedger:
    """Folds the stream's ``model.*`` events in order; delivery workers ask it for each one's verdict."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, memory: int = VERDICT_MEMORY) -> None:
        self.js = js
        self.subjects = subjects
        self.memory = memory
        self.outages: dict[str, Outage] = {}
        # Each source's own open model.down per (model, source), regardless of the merge.
        self.open_downs: dict[tuple[str, str], OpenDown] = {}
        self.verdicts: OrderedDict[int, Verdict] = OrderedDict()
        self.folded_to = 0  # the last stream sequence folded
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Replay every ``model.*`` event still in the stream."""
        await self.catch_up()
        if self.outages:
            log.info("models down at start: %s", ", ".join(sorted(self.outages)))

    async def catch_up(self) -> None:
        async with self._lock:
            await replay_events(self.js, self.subjects, KINDS, self._fold, self.folded_to + 1)

    async def verdict(self, seq: int, timeout: float = VERDICT_TIMEOUT_S) -> Verdict | None:
        """The verdict on the ``model.*`` event at stream sequence ``seq``; None when it cannot be had
        (bus trouble, or forgotten): the caller then delivers the event as it is."""
        if seq in self.verdicts:
            return self.verdicts[seq]
        if seq <= self.folded_to:
            return None
        try:
            async with asyncio.timeout(timeout):
                await self.catch_up()
        except (nats.errors.Error, TimeoutError) as e:
            log.warning("could not read model events to merge sources (%s): sending #%d unmerged", e, seq)
            return None
        return self.verdicts.get(seq)

    def downs_by(self, source: str) -> dict[str, OpenDown]:
        """The open ``model.down`` of ``source`` per model."""
        return {m: down for (m, s), down in self.open_downs.items() if s == source}

    def _fold(self, seq: int, data: bytes) -> None:
        if seq <= self.folded_to:
            return
        self.folded_to = seq
        try:
            ev = decode(data, Event)
        except DecodeError:
            return  # the delivery workers drop (and log) it
        if ev.kind not in KINDS:
            return
        try:
            said = said_of(ev)
        except DetailsError:
            return  # the delivery workers drop (and log) it
        key = (ev.subject, source_of(said))
        if isinstance(said, ModelDownDetails):
            self.open_downs[key] = OpenDown(ev, said)
        else:
            self.open_downs.pop(key, None)
        outage, verdict = _fold(self.outages.get(ev.subject), ev, said)
        if outage is None:
            self.outages.pop(ev.subject, None)
        else:
            self.outages[ev.subject] = outage
        self.verdicts[seq] = verdict
        while len(self.verdicts) > self.memory:
            self.verdicts.popitem(last=False)
