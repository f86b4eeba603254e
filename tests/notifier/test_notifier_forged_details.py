"""Events whose details hold the wrong types (a forger on the bus, a sender with a bug).

``details`` is an open map on the wire; the notifier read it with ``.get`` and trusted what it found.
A probe ``model.down`` with ``failures: "many"`` in the stream stopped the notifier at every start
(its probes take their state up from the stream); one with ``since: "yesterday"`` went out as if the
outage began when the event was written; a down whose ``since`` no clock can show made the next
recovery's summary raise inside the outage ledger. Now each such event is dropped with one log line,
like any message that does not decode, and the next one is delivered.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from llmgw_common.messages import Event, Webhook
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.notifier.notifier_helpers import Bus, ev, fast_settings, running


def _forged(kind: str, **details: Any) -> Event:
    return Event(
        id=f"forged-{kind}", kind=kind, subject="m1", time=time.time(), summary="forged", details=details
    )


@pytest.mark.parametrize(
    "forged",
    [
        _forged("model.down", source="probe", since=100.0, failures="many", last_error="x"),
        _forged("model.down", source="probe", since="yesterday"),
        _forged("model.down", since=1e300),
        _forged("model.recovered", source=5, since=100.0),
        _forged("model.evicted", replica="r1", nodes="n1", for_model="m2", idle_s=3.0),
    ],
    ids=["failures-many", "since-yesterday", "since-1e300", "source-5", "evicted-nodes-str"],
)
@pytest.mark.slow
async def test_an_event_with_wrong_typed_details_is_dropped_with_one_line_and_the_next_delivered(
    nats_server: NatsServer,
    prefix: str,
    bus: Bus,
    receivers: Any,
    caplog: pytest.LogCaptureFixture,
    forged: Event,
) -> None:
    rx = await receivers()
    await bus.set_webhooks(Webhook(url=rx.url))
    # Already in the stream when the notifier starts: the ledger replays it, the probes restore from it.
    await bus.publish(forged)
    # A recovery of the forged down's model: the ledger folds it after the forged down.
    rec = ev("model.recovered", "m1", 2, since=100.0)
    good = ev("node.lost", "n1", 3)
    with caplog.at_level(logging.INFO):
        async with running(fast_settings(nats_server, prefix)) as stats:
            await bus.publish(rec)
            await bus.publish(good)
            await eventually(
                lambda: good.id in rx.ids, timeout=15, what="the event after the forged one to be delivered"
            )
            assert stats.undecodable_events == 1
    assert forged.id not in rx.ids
    said = [r for r in caplog.records if forged.id in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].levelno == logging.WARNING and said[0].exc_info is None
    assert "details." in said[0].getMessage()  # names the field that does not fit
