"""Events and targets the delivery worker cannot handle must not stop the worker.

Deliveries to a webhook are in stream order: an exception that escaped the worker was met again first
after every restart, and no later event ever reached that webhook. An event that cannot be rendered
(a forged time the clock cannot show) is terminated and the next one goes; a request the HTTP client
refuses to make (a URL it cannot encode, written straight into the settings) is a failed attempt,
retried until ``retry_for_s`` like any other.
"""

from __future__ import annotations

from typing import Any

import pytest

from llmgw_common.codec import encode
from llmgw_common.messages import Event, Webhook
from llmgw_notifier.delivery import consumer_name
from llmgw_notifier.formats import render
from llmgw_notifier.posting import post_until_taken
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.targets import target_id
from llmgw_runtime.natsserver import NatsServer
from tests.http_clients import async_client
from tests.kit.poll import eventually
from tests.notifier.notifier_helpers import Bus, FakeTime, ev, fast_settings, running

# The IDNA codec refuses this host (an "xn--" label with no punycode): httpx raises UnicodeError, not
# an httpx.HTTPError, before any connection is made.
UNENCODABLE_URL = "http://xn--/hook"


@pytest.mark.parametrize(
    ("when", "window"),
    [
        (float("nan"), 0.0),
        (1e20, 0.0),
        # Grouped: the next event's time is "within the window" of a time far in the future, so both
        # are one group; it cannot be rendered, so each goes alone and only the good one is sent.
        (1e20, 0.5),
    ],
)
@pytest.mark.slow
async def test_an_unrenderable_event_is_terminated_and_the_next_delivered(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any, when: float, window: float
) -> None:
    rx = await receivers()
    await bus.set_webhooks(Webhook(url=rx.url))
    poison = Event(id="forged-time", kind="node.lost", subject="n0", time=when)
    good = ev("node.lost", "n1", 1)
    with pytest.raises((ValueError, OverflowError)):
        render([poison], Webhook(url=rx.url))  # what used to escape the worker
    async with running(fast_settings(nats_server, prefix, group_window_s=window)) as stats:
        await bus.js.publish(
            bus.subjects.event("node.lost"), encode(poison), stream=bus.subjects.events_stream
        )
        await bus.publish(good)
        await eventually(
            lambda: good.id in rx.ids, timeout=15, what="the event after the unrenderable one to be delivered"
        )
        await eventually(lambda: stats.delivered_events == 1, what="the good event to be acknowledged")
        info = await bus.settled(consumer_name(prefix, target_id(rx.url)))
        assert stats.unrenderable_events == 1
        assert stats.gave_up_events == 0
    assert rx.ids == [good.id]
    assert info.num_ack_pending == 0 and info.num_redelivered == 0  # terminated, not redelivered
    assert [e.id for e in await bus.events()] == [poison.id, good.id]  # it stays in the stream


async def test_a_url_the_client_refuses_is_retried_then_given_up_like_any_failure() -> None:
    t = FakeTime()
    s = NotifierSettings(retry_for_s=30.0, retry_base_s=1.0, retry_max_s=4.0)
    msg = render([ev("node.lost", "a", 1)], Webhook(url=UNENCODABLE_URL))
    async with async_client() as client:
        out = await post_until_taken(
            client, UNENCODABLE_URL, msg, s, clock=t.clock, sleep=t.sleep, rng=lambda: 0.0
        )
    assert not out.ok and out.last_error is not None and out.last_error.startswith("IDNAError")
    assert "xn--/hook" not in out.last_error  # the URL may be a credential: only its shown form
    assert sum(t.sleeps) == pytest.approx(30.0) and out.attempts == len(t.sleeps) + 1


@pytest.mark.slow
async def test_a_target_whose_url_the_client_refuses_gives_up_each_event_and_lives_on(
    nats_server: NatsServer, prefix: str, bus: Bus
) -> None:
    # Written straight into the settings key (``llmgw setup`` would have refused it).
    await bus.set_webhooks(Webhook(url=UNENCODABLE_URL))
    first, second = ev("node.lost", "n1", 1), ev("node.lost", "n2", 2)
    async with running(fast_settings(nats_server, prefix, retry_for_s=0.3)) as stats:
        await bus.publish(first)
        await bus.publish(second)
        await eventually(
            lambda: stats.gave_up_events == 2, timeout=15, what="the notifier to give up on both events"
        )
        info = await bus.settled(consumer_name(prefix, target_id(UNENCODABLE_URL)))
    assert stats.failed_attempts >= 2 and stats.delivered_events == 0
    assert info.num_ack_pending == 0 and info.num_redelivered == 0
