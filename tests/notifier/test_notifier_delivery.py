"""Delivery against real receivers and a real nats-server, the notifier running in this process."""

from __future__ import annotations

import time
from typing import Any

import nats.js.errors
import pytest

from llmgw_common.messages import Webhook
from llmgw_notifier.delivery import consumer_name
from llmgw_notifier.formats import verify
from llmgw_notifier.targets import target_id
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.notifier.notifier_helpers import Bus, ev, fast_settings, running


@pytest.mark.slow
async def test_slack_and_signed_json_payloads(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any
) -> None:
    slack, signed, plain = await receivers(), await receivers(), await receivers()
    await bus.set_webhooks(
        Webhook(url=slack.url, format="slack"),
        Webhook(url=signed.url, format="json", secret="s3cret"),
        Webhook(url=plain.url, format="json"),
    )
    async with running(fast_settings(nats_server, prefix)):
        lost = ev("node.lost", "gpu-a3", 1, replicas=2)
        await bus.publish(lost)
        await eventually(
            lambda: slack.requests and signed.requests and plain.requests,
            what="all three targets to receive a request",
        )

    text = slack.requests[0].json["text"]
    assert "gpu-a3" in text and "node lost" in text
    assert "UTC" in text  # since when
    assert "llmgw ctl nodes" in text  # what to do
    assert lost.summary in text

    got = signed.requests[0]
    body = got.json
    assert body["id"] == lost.id and body["kind"] == "node.lost" and body["subject"] == "gpu-a3"
    assert body["details"] == {"replicas": 2}
    assert body["timestamp"] == lost.time and body["time"].endswith("Z")
    assert got.event_id == lost.id
    assert verify(got.body, "s3cret", got.headers.get("X-Llmgw-Signature"))
    assert not verify(got.body, "wrong", got.headers.get("X-Llmgw-Signature"))
    assert not verify(got.body + b" ", "s3cret", got.headers.get("X-Llmgw-Signature"))
    assert "X-Llmgw-Signature" not in plain.requests[0].headers
    assert plain.requests[0].json["id"] == lost.id


@pytest.mark.slow
async def test_receiver_500_then_recovering_gets_every_event_once_in_order(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rx = await receivers()
    down_until = time.monotonic() + 1.5
    rx.answer = lambda r: 500 if time.monotonic() < down_until else 200
    await bus.set_webhooks(Webhook(url=rx.url))
    sent = [ev("node.lost", f"n{i}", i) for i in range(8)]
    async with running(fast_settings(nats_server, prefix, retry_base_s=0.1, retry_max_s=0.3)) as stats:
        for e in sent:
            await bus.publish(e)
        await eventually(lambda: len(rx.taken()) >= len(sent), what="the receiver to take every event")
        await eventually(lambda: stats.delivered_events == len(sent), what="every event to be acknowledged")
        info = await bus.settled(consumer_name(prefix, target_id(rx.url)))
    assert any(r.status == 500 for r in rx.requests), "the receiver never refused: the test proves nothing"
    assert [r.event_id for r in rx.taken()] == [e.id for e in sent]
    # Refused attempts were only ever for the first event not yet taken: order held while it was down.
    refused = [r.event_id for r in rx.requests if r.status != 200]
    assert set(refused) == {sent[0].id}
    assert info.num_ack_pending == 0 and info.ack_floor is not None and info.ack_floor.stream_seq == len(sent)
    assert "did not take" in caplog.text and rx.url not in caplog.text  # logged, without its URL


@pytest.mark.slow
async def test_storm_is_one_message(nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any) -> None:
    rx, slack = await receivers(), await receivers()
    await bus.set_webhooks(Webhook(url=rx.url), Webhook(url=slack.url, format="slack"))
    t0 = time.time()
    storm = [ev("node.lost", f"gpu-{i:02d}", i, t=t0 + i * 0.01) for i in range(40)]
    down = ev("model.down", "judge", 1, t=t0 + 0.5)
    async with running(fast_settings(nats_server, prefix, group_window_s=1.5)) as stats:
        for e in storm:
            await bus.publish(e)
        await bus.publish(down)
        await eventually(
            lambda: len(rx.requests) >= 2 and len(slack.requests) >= 2,
            what="both targets to receive two messages each",
        )
        await eventually(lambda: stats.delivered_events == 2 * 41, what="all 82 events to be acknowledged")
        info = await bus.settled(consumer_name(prefix, target_id(rx.url)))
    assert len(rx.requests) == 2
    group = rx.requests[0].json
    assert group["grouped"] is True and group["kind"] == "node.lost"
    assert group["subjects"] == [e.subject for e in storm]
    assert [x["id"] for x in group["events"]] == [e.id for e in storm]
    assert rx.requests[0].event_id == group["id"] and group["id"].startswith("group-")
    assert rx.requests[1].json["id"] == down.id
    text = slack.requests[0].json["text"]
    assert "40 nodes lost" in text and "gpu-00" in text and "gpu-39" in text
    assert info.num_ack_pending == 0 and info.ack_floor is not None and info.ack_floor.stream_seq == 41


@pytest.mark.slow
async def test_new_webhook_takes_effect_without_restart_and_removed_one_stops(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any
) -> None:
    a, b = await receivers(), await receivers()
    await bus.set_webhooks(Webhook(url=a.url))
    async with running(fast_settings(nats_server, prefix)):
        first = ev("node.lost", "n1", 1)
        await bus.publish(first)
        await eventually(lambda: a.ids == [first.id], what="target a to get the first event")

        await bus.set_webhooks(Webhook(url=a.url), Webhook(url=b.url, events=("model.*",)))
        await bus.wait_consumer(consumer_name(prefix, target_id(b.url)))
        second, third = ev("node.lost", "n2", 2), ev("model.down", "judge", 3)
        await bus.publish(second)
        await bus.publish(third)
        await eventually(
            lambda: b.ids == [third.id] and a.ids[-1:] == [third.id],
            what="both targets to deliver the third event",
        )
        assert a.ids == [first.id, second.id, third.id]  # b's filter does not affect a

        await bus.set_webhooks(Webhook(url=b.url, events=("model.*",)))
        await bus.wait_consumer(consumer_name(prefix, target_id(a.url)), present=False)
        fourth = ev("model.recovered", "judge", 4)
        await bus.publish(fourth)
        await eventually(lambda: b.ids[-1:] == [fourth.id], what="target b to deliver the fourth event")
    assert a.ids == [first.id, second.id, third.id]
    assert b.ids == [third.id, fourth.id]  # the first two were before it was added / filtered out


@pytest.mark.slow
async def test_gives_up_after_retry_for_and_moves_on(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any
) -> None:
    rx = await receivers()
    doomed, next_one = ev("node.lost", "n1", 1), ev("node.lost", "n2", 2)
    rx.answer = lambda r: 500 if r.event_id == doomed.id else 200
    await bus.set_webhooks(Webhook(url=rx.url))
    # The budget is wall time from the first POST: 0.6 s let one slow attempt on a loaded box spend it
    # all (one attempt, then gave up). Twice the longest an attempt may take (http_timeout_s) leaves room
    # for a retry whatever the first one cost.
    s = fast_settings(nats_server, prefix)
    async with running(s.model_copy(update={"retry_for_s": 2 * s.http_timeout_s})) as stats:
        await bus.publish(doomed)
        await bus.publish(next_one)
        await eventually(
            lambda: next_one.id in rx.ids,
            timeout=30,
            what="the next event to be delivered after giving up on the first",
        )
        await eventually(lambda: stats.delivered_events == 1, what="the next event to be acknowledged")
        assert stats.gave_up_events == 1
        info = await bus.settled(consumer_name(prefix, target_id(rx.url)))
    assert rx.ids.count(doomed.id) >= 2  # it was retried before giving up
    assert rx.ids[-1] == next_one.id
    assert info.num_ack_pending == 0 and info.num_redelivered == 0  # terminated, not left to redeliver


async def test_undecodable_event_is_dropped_and_the_next_delivered(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any
) -> None:
    rx = await receivers()
    await bus.set_webhooks(Webhook(url=rx.url))
    good = ev("node.lost", "n1", 1)
    async with running(fast_settings(nats_server, prefix)) as stats:
        await bus.js.publish(
            bus.subjects.event("node.lost"), b"\xc1not msgpack", stream=bus.subjects.events_stream
        )
        await bus.publish(good)
        await eventually(lambda: rx.ids == [good.id], what="the good event to be delivered")
        assert stats.undecodable_events == 1


@pytest.mark.slow
async def test_undecodable_settings_keep_the_known_targets(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any
) -> None:
    rx = await receivers()
    name = consumer_name(prefix, target_id(rx.url))
    await bus.set_webhooks(Webhook(url=rx.url))
    async with running(fast_settings(nats_server, prefix)) as stats:
        await bus.wait_consumer(name)
        await bus.buckets[bus.subjects.bucket_desired].put("settings", b"garbage")
        await eventually(lambda: bool(stats.up), what="the notifier to be up")
        e = ev("node.lost", "n1", 1)
        await bus.publish(e)
        await eventually(lambda: rx.ids == [e.id], what="the event to be delivered under the old settings")
    # Started with garbage in the settings: the target's consumer (its place in the stream) is kept.
    async with running(fast_settings(nats_server, prefix)) as stats:
        await eventually(lambda: bool(stats.up), what="the notifier to be up")
        assert name in await bus.consumer_names()


@pytest.mark.slow
async def test_no_settings_key_means_no_targets_and_stale_consumers_go(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any
) -> None:
    rx = await receivers()
    name = consumer_name(prefix, target_id(rx.url))
    await bus.set_webhooks(Webhook(url=rx.url))
    async with running(fast_settings(nats_server, prefix)):
        await bus.wait_consumer(name)
    # The webhook disappears while the notifier is down: a new start removes its consumer.
    await bus.buckets[bus.subjects.bucket_desired].delete("settings")
    async with running(fast_settings(nats_server, prefix)) as stats:
        await eventually(lambda: bool(stats.up), what="the notifier to be up")
        await bus.wait_consumer(name, present=False)
    with pytest.raises(nats.js.errors.NotFoundError):
        await bus.js.consumer_info(bus.subjects.events_stream, name)
