"""One outage seen by two sources, through a real bus and real receivers: one down, one recovered."""

from __future__ import annotations

import time
from typing import Any

import nats
import pytest

from llmgw_common.catalog import WatchSpec
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, Event, RoutingEndpoints, Webhook
from llmgw_common.subjects import ROUTING_ENDPOINTS, Subjects
from llmgw_notifier.delivery import consumer_name
from llmgw_notifier.outages import DOWN, RECOVERED, OutageLedger
from llmgw_notifier.targets import target_id
from llmgw_runtime.bus import ensure_all
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.notifier.notifier_helpers import Bus, fast_settings, running
from tests.notifier.test_notifier_probes import FakeRouter, probe_settings


def cp(kind: str, model: str, t: float) -> Event:
    return Event(id=f"{kind}:{model}:{int(t * 1000)}", kind=kind, subject=model, time=t, summary=kind)


def pr(kind: str, model: str, t: float, episode: float) -> Event:
    return Event(
        id=f"{kind}:{model}:probe:{int(episode * 1000)}",
        kind=kind,
        subject=model,
        time=t,
        summary=kind,
        details={"source": "probe", "since": episode, "failures": 2, "last_error": "HTTP 503"},
    )


@pytest.mark.slow
async def test_two_sources_one_outage_live_and_after_a_restart(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any
) -> None:
    slack, plain = await receivers(), await receivers()
    await bus.set_webhooks(Webhook(url=slack.url, format="slack"), Webhook(url=plain.url))
    t = time.time()
    # First outage, live: the ledger catches up as each event arrives.
    first = [cp(DOWN, "judge", t), pr(DOWN, "judge", t + 1, t + 0.5), cp(RECOVERED, "judge", t + 2)]
    async with running(fast_settings(nats_server, prefix)) as stats:
        await eventually(lambda: stats.up, what="the notifier to be up")
        for e in first:
            await bus.publish(e)
        await eventually(
            lambda: len(plain.taken()) == 1 and len(slack.taken()) == 1,
            what="both targets to take the model.down",
        )
        for r in (slack, plain):
            info = await bus.settled(consumer_name(prefix, target_id(r.url)))
            assert info.num_pending == 0 and info.num_ack_pending == 0  # all three decided and acknowledged
        assert stats.merged_events == 4  # the probe's down and the control plane's recovery, per target
    assert plain.ids == [first[0].id]
    assert plain.requests[0].json["details"]["sources"] == ["controlplane"]
    # The probes' recovery arrives after a restart: the merged state was rebuilt from the stream.
    last = pr(RECOVERED, "judge", t + 3, t + 0.5)
    # A second outage happens entirely while the notifier is down (a backlog folded at start).
    second = [pr(DOWN, "judge", t + 10, t + 9), cp(DOWN, "judge", t + 11)]
    second += [cp(RECOVERED, "judge", t + 12), pr(RECOVERED, "judge", t + 13, t + 9)]
    for e in [last, *second]:
        await bus.publish(e)
    async with running(fast_settings(nats_server, prefix)) as stats:
        await eventually(
            lambda: len(plain.taken()) == 4 and len(slack.taken()) == 4,
            what="both targets to take the rest of the events",
        )
        for r in (slack, plain):
            await bus.settled(consumer_name(prefix, target_id(r.url)))
        assert stats.merged_events == 2 * 2  # the second outage's control plane down and recovery
    assert plain.ids == [first[0].id, last.id, second[0].id, second[3].id]
    assert slack.ids == plain.ids
    rec = plain.requests[1].json
    assert rec["details"]["sources"] == ["controlplane", "probe"] and rec["details"]["down_id"] == first[0].id
    assert "reported down by controlplane and probe" in slack.requests[1].json["text"]


async def test_ledger_forgets_old_verdicts_and_survives_a_lost_bus(
    nats_server: NatsServer, prefix: str
) -> None:
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    bus = Bus(nc, js, subjects, await ensure_all(js, subjects))
    t = time.time()
    for e in (cp(DOWN, "a", t), cp(DOWN, "b", t), cp(RECOVERED, "a", t + 1)):
        await bus.publish(e)
    ledger = OutageLedger(js, subjects, memory=2)
    await ledger.start()
    assert ledger.folded_to == 3 and set(ledger.outages) == {"b"}
    assert await ledger.verdict(1) is None  # forgotten: the worker sends it as it is
    v = await ledger.verdict(3)
    assert v is not None and v.deliver and v.event.details["sources"] == ["controlplane"]
    await bus.publish(pr(DOWN, "b", t + 2, t + 1))
    v = await ledger.verdict(4)  # beyond what was folded: caught up on demand
    assert v is not None and not v.deliver and ledger.downs_by("probe").keys() == {"b"}
    await nc.close()
    assert await ledger.verdict(5, timeout=2.0) is None  # the bus is gone: unmerged, not stuck


@pytest.mark.slow
async def test_probe_failures_count_only_once_the_model_was_up(
    nats_server: NatsServer, prefix: str, bus: Bus
) -> None:
    router = await FakeRouter().start()
    try:
        router.mode = "fail"  # its first replica is still starting
        await bus.set_watched({"judge": WatchSpec(probe_every=0.1, budget=0.5, failures=1)})
        kv = bus.buckets[bus.subjects.bucket_routing]

        async def endpoints(draining: bool) -> None:
            ep = Endpoint(replica_id="r1", model="judge", url="http://x", node="n1", draining=draining)
            await kv.put(ROUTING_ENDPOINTS, encode(RoutingEndpoints(version=1, endpoints={"judge": (ep,)})))

        async with running(probe_settings(nats_server, prefix, router)):
            await eventually(lambda: router.count("judge") >= 5, what="five failing probes of judge")
            await endpoints(draining=True)  # a draining endpoint is not a ready one
            n = router.count("judge")
            await eventually(lambda: router.count("judge") >= n + 5, what="more failing probes of judge")
            assert await bus.events((DOWN, RECOVERED)) == []
            await endpoints(draining=False)  # it was up: now failures count
            await eventually(lambda: bus.events((DOWN, RECOVERED)), what="a model.down event on the bus")
        (down,) = await bus.events((DOWN, RECOVERED))
        assert down.kind == DOWN and down.details["source"] == "probe"
    finally:
        await router.stop()
