"""EventPublisher against a real nats-server: nothing is dropped while the stream takes events; only an
unreachable stream bounds the queue, and then one line says how many went."""

from __future__ import annotations

import logging

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.messages import Event
from llmgw_common.subjects import Subjects
from llmgw_controlplane.events import EventPublisher
from llmgw_runtime import bus


def _events(n: int) -> list[Event]:
    return [
        Event(id=f"node.lost:n{i}:1000", kind="node.lost", subject=f"n{i}", time=1000.0, summary="lost")
        for i in range(n)
    ]


@pytest.mark.slow
async def test_a_pass_of_1500_events_reaches_the_stream_whole(bus_nc: NATS, prefix: str) -> None:
    subj = Subjects(prefix)
    js = bus_nc.jetstream()
    await bus.ensure_stream(js, subj.events_stream, [subj.all_events()], max_age_s=3600)
    pub = EventPublisher(js, subj)
    await pub.publish(_events(1500))
    info = await js.stream_info(subj.events_stream)
    assert info.state.messages == 1500
    assert pub.published == 1500 and not pub.pending
    # The first and the last are both there (the oldest are not the ones dropped).
    first = await js.get_msg(subj.events_stream, info.state.first_seq)
    last = await js.get_msg(subj.events_stream, info.state.last_seq)
    assert first.headers and first.headers["Nats-Msg-Id"] == "node.lost:n0:1000"
    assert last.headers and last.headers["Nats-Msg-Id"] == "node.lost:n1499:1000"


@pytest.mark.slow
async def test_unreachable_stream_bounds_the_queue_with_one_line(
    bus_nc: NATS, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    subj = Subjects(prefix)  # no stream was made for this prefix: every publish fails
    pub = EventPublisher(bus_nc.jetstream(), subj)
    with caplog.at_level(logging.WARNING, logger="llmgw.controlplane.events"):
        await pub.publish(_events(1500))
    assert len(pub.pending) == EventPublisher.MAX_PENDING and pub.published == 0
    # The newest are kept; the oldest went, and one line says how many.
    assert pub.pending[0].subject == "n500" and pub.pending[-1].subject == "n1499"
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped == ["event stream unreachable: 500 oldest events dropped (1000 kept for retry)"]
    # Once the stream exists, everything kept is delivered on the next publish.
    js = bus_nc.jetstream()
    await bus.ensure_stream(js, subj.events_stream, [subj.all_events()], max_age_s=3600)
    await pub.publish([])
    assert (await js.stream_info(subj.events_stream)).state.messages == 1000 and not pub.pending
