"""What each kind of :class:`~llmgw_common.messages.Event` carries in ``details``, typed.

On the wire ``Event.details`` stays an open map (a newer sender may add keys; an older reader ignores
them, and the notifier passes them to webhook receivers as they are). The typing lives at the edges:
producers build the map from a model here (:meth:`EventDetails.wire`), and readers parse it with
:func:`parse_details` or :meth:`EventDetails.of` before they trust a field. A map whose known keys hold
the wrong types (a forger on the bus, a sender with a bug) raises :class:`DetailsError`, a
:class:`~llmgw_common.codec.DecodeError`: such an event is dropped like any message that does not
decode, never half-read.

Numbers are strict (``since: "1.5"`` or ``true`` is not a time), and a time must be one the clock can
show, so a forged ``1e300`` cannot crash whoever formats it later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmgw_common.codec import DecodeError
from llmgw_common.messages import Event

# The last second ``datetime.fromtimestamp`` can show (9999-12-31T23:59:59Z).
MAX_TIMESTAMP = 253_402_300_799.0

# A wall-clock time (UNIX s) that can be shown as a date.
Timestamp = Annotated[float, Field(strict=True, ge=0.0, le=MAX_TIMESTAMP, allow_inf_nan=False)]
# A duration in seconds.
Seconds = Annotated[float, Field(strict=True, ge=0.0, allow_inf_nan=False)]
Count = Annotated[int, Field(strict=True, ge=0)]
Text = Annotated[str, Field(strict=True)]

D = TypeVar("D", bound="EventDetails")


class DetailsError(DecodeError):
    """An event whose ``details`` do not fit its kind's model."""


class EventDetails(BaseModel):
    """Base of every kind's details. Like a message: frozen, unknown keys ignored (open world)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    KIND: ClassVar[str]

    def wire(self) -> dict[str, Any]:
        """The map ``Event.details`` carries: the fields given, in declared order (the order the
        producers always wrote them, so the bytes on the wire and in webhook bodies are unchanged)."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in self.model_dump(exclude_unset=True).items()
        }

    @classmethod
    def of(cls: type[D], ev: Event) -> D:
        """``ev``'s details as this model; :class:`DetailsError` when they do not fit it."""
        return _validate(cls, ev)


# ---------------------------------------------------------------- the control plane: nodes, placement


class NodeLostDetails(EventDetails):
    KIND = "node.lost"


class NodeRecoveredDetails(EventDetails):
    KIND = "node.recovered"


class PlacementFailingDetails(EventDetails):
    KIND = "placement.failing"

    reason: Text
    since: Timestamp  # when the model became unplaceable


# ---------------------------------------------------------------- watched models: two sources


class ModelDownDetails(EventDetails):
    """A watched model is down. Said by the control plane (no ``source``: reason, since, budget) or by
    the notifier's probes (``source: probe``, since, budget_s, probe_every_s, router, failures,
    last_error); the notifier adds ``sources`` (and ``previous_down``) when it delivers the merge."""

    KIND = "model.down"

    source: Text | None = None  # absent: the control plane
    reason: Text | None = None
    since: Timestamp | None = None  # the outage's start; absent: the event's time
    budget: Seconds | None = None
    budget_s: Seconds | None = None
    probe_every_s: Seconds | None = None
    router: Text | None = None
    failures: Count | None = None
    last_error: Text | None = None
    sources: tuple[Text, ...] | None = None
    previous_down: Text | None = None  # the id of a down whose end was never reported


class ModelRecoveredDetails(EventDetails):
    """A watched model is back, by the word of the control plane (since) or the probes (``source:
    probe``, since, budget_s, probe_every_s, router, down_for_s); the notifier adds ``sources``,
    ``down_since``, ``down_id`` and ``cleared`` when it delivers the merge."""

    KIND = "model.recovered"

    source: Text | None = None  # absent: the control plane
    since: Timestamp | None = None  # the start of the outage that ended
    budget_s: Seconds | None = None
    probe_every_s: Seconds | None = None
    router: Text | None = None
    down_for_s: Seconds | None = None
    sources: tuple[Text, ...] | None = None
    down_since: Timestamp | None = None
    down_id: Text | None = None
    cleared: tuple[Text, ...] | None = None  # open claims a real answer outlived


# ---------------------------------------------------------------- scaling (issue 13)


class ModelScaledToZeroDetails(EventDetails):
    KIND = "model.scaled_to_zero"

    idle_after: Seconds


class ModelWokenDetails(EventDetails):
    KIND = "model.woken"

    cold_start_s: Seconds  # from the first request for it to a replica serving


class ModelEvictedDetails(EventDetails):
    KIND = "model.evicted"

    replica: Text
    nodes: tuple[Text, ...]
    for_model: Text  # the model it made room for
    idle_s: Seconds


# ---------------------------------------------------------------- following the load (issue 21)


class ModelScaledUpDetails(EventDetails):
    KIND = "model.scaled_up"

    replicas_from: Count
    replicas_to: Count
    target: Text  # e.g. "waiting_per_replica 2"
    measured: float = Field(strict=True, ge=0.0, allow_inf_nan=False)
    for_s: Seconds  # how long the target had been exceeded
    reason: Text  # the one line ctl status shows


class ModelScaledDownDetails(EventDetails):
    KIND = "model.scaled_down"

    replicas_from: Count
    replicas_to: Count
    target: Text
    measured: float = Field(strict=True, ge=0.0, allow_inf_nan=False)
    for_s: Seconds  # how long the load had been below target
    reason: Text
    replica: Text  # the replica drained (it finishes what it serves, then stops)


DETAILS: Mapping[str, type[EventDetails]] = {
    c.KIND: c
    for c in (
        NodeLostDetails,
        NodeRecoveredDetails,
        PlacementFailingDetails,
        ModelDownDetails,
        ModelRecoveredDetails,
        ModelScaledToZeroDetails,
        ModelWokenDetails,
        ModelEvictedDetails,
        ModelScaledUpDetails,
        ModelScaledDownDetails,
    )
}


def parse_details(ev: Event) -> EventDetails | None:
    """``ev``'s details as its kind's model; None for a kind this build does not know (a newer
    sender's: passed on as it is). :class:`DetailsError` when they do not fit."""
    cls = DETAILS.get(ev.kind)
    return None if cls is None else _validate(cls, ev)


def event(details: EventDetails, *, id: str, subject: str, time: float, summary: str) -> Event:
    """An event of ``details``' kind carrying them."""
    return Event(
        id=id, kind=details.KIND, subject=subject, time=time, summary=summary, details=details.wire()
    )


def _validate(cls: type[D], ev: Event) -> D:
    try:
        return cls.model_validate(ev.details)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise DetailsError(
            f"{ev.kind} event {ev.id!r}: details.{loc}: {first['msg']} ({e.error_count()} problem(s))"
        ) from None
