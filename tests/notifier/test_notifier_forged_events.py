"""Events whose text cannot go into an HTTP header as is (a forger on the bus, or any future kind).

The notifier names each delivery in headers (``X-Llmgw-Event-Id``, ``X-Llmgw-Event-Kind``). A value
that is not ASCII made the HTTP client raise before sending; the delivery worker died, was restarted,
got the same event back first (deliveries are in order) and died again: one such event stopped every
later delivery to that webhook.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from llmgw_common.codec import encode
from llmgw_common.messages import Event, Webhook
from llmgw_notifier.formats import EVENT_ID_HEADER, EVENT_KIND_HEADER, render
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.notifier.notifier_helpers import Bus, ev, fast_settings, running


def _forged(field: str) -> Event:
    base: dict[str, Any] = dict(
        id="forged-1", kind="model.down", subject="m1", time=time.time(), summary="forged"
    )
    base[field] = {"id": "forged-é\r\nX-Evil: 1", "kind": "model.dówn\r\nX-Evil: 1"}[field]
    return Event(**base)


@pytest.mark.parametrize("field", ["id", "kind"])
@pytest.mark.slow
async def test_an_event_with_non_ascii_header_text_is_delivered_and_so_is_the_next(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any, field: str
) -> None:
    rx = await receivers()
    await bus.set_webhooks(Webhook(url=rx.url))
    forged = _forged(field)
    good = ev("node.lost", "n1", 1)
    async with running(fast_settings(nats_server, prefix)):
        await bus.js.publish(
            bus.subjects.event("model.down"),
            encode(forged),
            stream=bus.subjects.events_stream,
        )
        await bus.publish(good)
        await eventually(
            lambda: good.id in rx.ids, timeout=15, what="the event after the forged one to be delivered"
        )
    first = rx.requests[0]
    # The forged one went out first, its text whole in the body, its headers plain ASCII, one each.
    assert first.json[field] == getattr(forged, field)
    assert "X-Evil" not in first.headers
    for name in (EVENT_ID_HEADER, EVENT_KIND_HEADER):
        assert first.headers[name].isascii() and "\r" not in first.headers[name]


def test_header_values_are_ascii_and_say_what_they_stand_for() -> None:
    r = render([_forged("kind")], Webhook(url="http://x/hook"))
    assert r.headers[EVENT_KIND_HEADER] == "model.d\\xf3wn\\r\\nX-Evil: 1"
    r = render([ev("node.lost", "n1", 1)], Webhook(url="http://x/hook"))
    assert r.headers[EVENT_ID_HEADER] == "node.lost:n1:1"
    assert r.headers[EVENT_KIND_HEADER] == "node.lost"
