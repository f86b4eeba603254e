"""The notifier's Prometheus metrics, scraped over HTTP from a notifier running against real receivers
and a real nats-server."""

from __future__ import annotations

import logging
import socket
from typing import Any

import httpx
import pytest

from llmgw_common.messages import Webhook
from llmgw_notifier.targets import target_id
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import free_port
from tests.kit.poll import eventually
from tests.kit.promtext import value
from tests.notifier.notifier_helpers import Bus, Received, ev, fast_settings, running


async def scrape(port: int) -> str:
    async with httpx.AsyncClient() as http:
        r = await http.get(f"http://127.0.0.1:{port}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    return r.text


async def listening(port: int) -> None:
    """Wait for the metrics listener: it starts once the notifier has bound its buckets."""

    async def up() -> bool:
        try:
            await scrape(port)
        except httpx.ConnectError:
            return False
        return True

    await eventually(up, what=f"the notifier's metrics on port {port}")


@pytest.mark.slow
async def test_deliveries_failed_attempts_lag_and_oldest_undelivered(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any
) -> None:
    rx = await receivers()
    tid = target_id(rx.url)
    failures = {"n": 2}

    def answer(r: Received) -> int:
        if r.event_id == "node.lost:gpu-a:1" and failures["n"] > 0:
            failures["n"] -= 1
            return 500
        return 200

    rx.answer = answer
    rx.hang_on = {"node.lost:gpu-b:2"}
    await bus.set_webhooks(Webhook(url=rx.url, format="json"))
    port = free_port()
    async with running(fast_settings(nats_server, prefix, metrics_port=port)):
        await listening(port)
        await bus.publish(ev("node.lost", "gpu-a", 1))
        await eventually(lambda: len(rx.taken()) == 1, what="the first event taken after two 500s")
        await bus.publish(ev("node.lost", "gpu-b", 2))
        await eventually(
            lambda: len(rx.requests) == 4, what="the second event sent, and held by the receiver"
        )

        async def held_for_a_while() -> str | None:
            text = await scrape(port)
            age = value(text, "llmgw_notifier_oldest_undelivered_seconds", target=tid)
            return text if age is not None and age > 0.2 else None

        text = await eventually(held_for_a_while, what="the held event's age in the metrics")
        assert value(text, "llmgw_notifier_up") == 1
        assert value(text, "llmgw_notifier_deliveries_total", outcome="delivered") == 1
        assert value(text, "llmgw_notifier_failed_attempts_total") == 2
        assert value(text, "llmgw_notifier_delivery_lag_seconds_count") == 1

        rx.release.set()

        async def all_delivered() -> str | None:
            text = await scrape(port)
            done = value(text, "llmgw_notifier_deliveries_total", outcome="delivered") == 2
            # Counted at the receiver's 2xx; no longer held once the ack's flush returns, a moment later.
            acked = value(text, "llmgw_notifier_oldest_undelivered_seconds", target=tid) == 0
            return text if done and acked else None

        text = await eventually(all_delivered, what="both events delivered and acked in the metrics")
        assert value(text, "llmgw_notifier_delivery_lag_seconds_count") == 2
        assert value(text, "llmgw_notifier_deliveries_total", outcome="gave_up") == 0
        # The target is named by its id, never by its URL (a Slack URL is a credential).
        assert rx.url not in text


@pytest.mark.slow
async def test_a_message_given_up_is_counted(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any
) -> None:
    rx = await receivers()
    rx.answer = lambda r: 503
    await bus.set_webhooks(Webhook(url=rx.url, format="json"))
    port = free_port()
    async with running(fast_settings(nats_server, prefix, metrics_port=port, retry_for_s=0.3)):
        await listening(port)
        await bus.publish(ev("node.lost", "gpu-a", 1))

        async def gave_up() -> bool:
            return value(await scrape(port), "llmgw_notifier_deliveries_total", outcome="gave_up") == 1

        await eventually(gave_up, what="the event given up in the metrics")
        text = await scrape(port)
        attempts = value(text, "llmgw_notifier_failed_attempts_total")
        assert attempts is not None and attempts >= 1
        assert value(text, "llmgw_notifier_deliveries_total", outcome="delivered") == 0


async def test_a_taken_metrics_port_does_not_stop_delivery(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rx = await receivers()
    await bus.set_webhooks(Webhook(url=rx.url, format="json"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="llmgw.notifier.metrics"):
            async with running(fast_settings(nats_server, prefix, metrics_port=port)):
                await bus.publish(ev("node.lost", "gpu-a", 1))
                await eventually(lambda: len(rx.taken()) == 1, what="the event delivered all the same")
    assert any(
        "metrics listener not started" in r.message and str(port) in r.message for r in caplog.records
    ), [r.message for r in caplog.records]
