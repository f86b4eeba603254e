"""Typed event details (issue 15): every kind emitted has a model, the wire stays as it was, and a
forged map is refused at the edge instead of being half-read.

``details`` stays an open map on the wire: the bytes of every event the producers make, and the JSON a
receiver gets, are what they were when the producers wrote the maps by hand (the literal maps below
are those producers' code, key order included).
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest

from llmgw_common.catalog import WatchSpec
from llmgw_common.codec import encode
from llmgw_common.event_details import (
    DETAILS,
    DetailsError,
    ModelDownDetails,
    ModelEvictedDetails,
    ModelRecoveredDetails,
    parse_details,
)
from llmgw_common.messages import Event, Webhook
from llmgw_controlplane.scheduler import autoscale
from llmgw_controlplane.scheduler import event_detection as cp_events
from llmgw_controlplane.scheduler.event_detection import EventDetector
from llmgw_notifier import formats
from llmgw_notifier.outages import DOWN, RECOVERED, fold
from llmgw_notifier.outages import KINDS as MERGED_KINDS
from llmgw_notifier.probe_state import ProbeState, Transition, probe_event

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_kind_the_control_plane_and_the_notifier_emit_has_a_model() -> None:
    emitted = {*cp_events.KINDS, *autoscale.KINDS, DOWN, RECOVERED, *MERGED_KINDS}
    assert emitted <= set(DETAILS), emitted - set(DETAILS)
    # ... and every kind with a model has a title and a what-to-do in the notifier's formats.
    assert set(formats._KINDS) == set(DETAILS)
    for kind, cls in DETAILS.items():
        assert cls.KIND == kind


@pytest.mark.slow
def test_no_service_builds_an_event_but_from_a_details_model() -> None:
    """Producers go through ``event_details.event``; a hand-written ``Event(...)`` would carry an
    untyped map (and a kind no model covers)."""
    makers = []
    for path in sorted([*(ROOT / "services").rglob("*.py"), *(ROOT / "libs").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Event":
                makers.append(str(path.relative_to(ROOT)))
    assert makers == ["libs/llmgw_common/llmgw_common/event_details.py"]


def _event(kind: str, details: dict[str, Any], t: float = 160.0) -> Event:
    return Event(id=f"{kind}:judge:1", kind=kind, subject="judge", time=t, summary="s", details=details)


def test_the_control_planes_events_are_on_the_wire_as_they_were() -> None:
    d = EventDetector(placement_failing_after_s=60.0)
    d.models({"m": 1}, {"m": 20.0}, {}, 100.0)
    (down,) = d.models({}, {"m": 20.0}, {"m": "no ready replica"}, 120.0)
    assert list(down.details.items()) == [("reason", "no ready replica"), ("since", 100.0), ("budget", 20.0)]
    (rec,) = d.models({"m": 1}, {"m": 20.0}, {}, 130.0)
    assert rec.details == {"since": 100.0}
    d.placement({"m": "needs 8 H100"}, 0.0)
    (failing,) = d.placement({"m": "needs 8 H100"}, 60.0)
    assert list(failing.details.items()) == [("reason", "needs 8 H100"), ("since", 0.0)]
    evicted = ModelEvictedDetails(replica="r1", nodes=("a", "b"), for_model="big", idle_s=12.5).wire()
    assert list(evicted.items()) == [
        ("replica", "r1"),
        ("nodes", ["a", "b"]),
        ("for_model", "big"),
        ("idle_s", 12.5),
    ]


def test_probe_events_are_on_the_wire_as_they_were() -> None:
    spec = WatchSpec(probe_every=30, budget=20, failures=3)
    st = ProbeState(failures=3, streak_start=100.0, down_since=100.0, last_error="no answer", answered=True)
    down = probe_event("judge", Transition(DOWN, 100.0), st, spec, 160.0, "http://r")
    old = {
        "source": "probe",
        "since": 100.0,
        "budget_s": 20.0,
        "probe_every_s": 30.0,
        "router": "http://r",
        "failures": 3,
        "last_error": "no answer",
    }
    assert encode(down) == encode(down.model_copy(update={"details": old}))
    rec = probe_event("judge", Transition(RECOVERED, 100.0), ProbeState(), spec, 400.0, "http://r")
    old = {
        "source": "probe",
        "since": 100.0,
        "budget_s": 20.0,
        "probe_every_s": 30.0,
        "router": "http://r",
        "down_for_s": 300.0,
    }
    assert encode(rec) == encode(rec.model_copy(update={"details": old}))


def test_the_merged_details_keep_a_newer_senders_keys_and_their_order() -> None:
    hook = Webhook(url="http://x/hook")
    down = _event(DOWN, {"reason": "r", "since": 10.0, "budget": 5.0, "future": {"a": 1}}, 20.0)
    outage, v = fold(None, down)
    assert list(v.event.details.items()) == [
        ("reason", "r"),
        ("since", 10.0),
        ("budget", 5.0),
        ("future", {"a": 1}),
        ("sources", ["controlplane"]),
    ]
    assert (
        b'"details":{"reason":"r","since":10.0,"budget":5.0,"future":{"a":1},"sources":["controlplane"]}'
        in (formats.render([v.event], hook).body)
    )
    outage, _ = fold(outage, _event(DOWN, {"source": "probe", "since": 12.0}, 25.0))
    rec = _event(RECOVERED, {"source": "probe", "since": 12.0}, 30.0)
    _, v = fold(outage, rec)
    assert v.deliver
    assert list(v.event.details.items()) == [
        ("source", "probe"),
        ("since", 12.0),
        ("sources", ["controlplane", "probe"]),
        ("down_since", 10.0),
        ("down_id", down.id),
        ("cleared", ["controlplane"]),
    ]


@pytest.mark.parametrize(
    ("down", "why"),
    [
        (_event(DOWN, {"since": 1e300}), "details.since"),
        # No since: the event's own time is the outage's start, and no clock can show this one.
        (_event(DOWN, {}, t=1e20), "cannot be shown"),
    ],
    ids=["since-1e300", "time-1e20"],
)
def test_a_down_whose_start_no_clock_can_show_is_not_folded(down: Event, why: str) -> None:
    """Folded, its recovery's summary (``since HH:MM:SS UTC``) raised inside the outage ledger, which
    the notifier replays at start: it could not start while the event was in the stream."""
    outage, v = fold(None, down)
    assert outage is None and not v.deliver and why in v.reason
    rec = _event(RECOVERED, {"since": 100.0}, 200.0)
    outage, v = fold(outage, rec)
    assert outage is None and not v.deliver and "no open model.down" in v.reason


@pytest.mark.parametrize(
    ("details", "field"),
    [
        ({"since": "yesterday"}, "details.since"),
        ({"since": True}, "details.since"),  # a bool is not a time
        ({"since": float("nan")}, "details.since"),
        ({"source": "probe", "failures": "many"}, "details.failures"),
        ({"source": "probe", "failures": 2.5}, "details.failures"),
        ({"source": 5}, "details.source"),
        ({"sources": "controlplane"}, "details.sources"),
    ],
)
def test_wrong_typed_details_name_the_field(details: dict[str, Any], field: str) -> None:
    with pytest.raises(DetailsError, match=field):
        parse_details(_event(DOWN, details))


def test_parsing_is_open_to_newer_senders() -> None:
    said = parse_details(_event(DOWN, {"since": 10, "failures": 2, "new_key": [1, 2]}))
    assert said == ModelDownDetails(since=10.0, failures=2)
    assert isinstance(parse_details(_event(RECOVERED, {})), ModelRecoveredDetails)
    assert parse_details(_event("model.renamed", {"since": "whenever"})) is None  # a kind we do not know
