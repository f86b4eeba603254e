"""Notifier fixtures: real HTTP receivers and a bus client on the session's nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import nats
import pytest

from llmgw_common.subjects import Subjects
from llmgw_runtime.bus import ensure_all
from llmgw_runtime.natsserver import NatsServer
from tests.notifier.notifier_helpers import Bus, Receiver


@pytest.fixture
async def receivers() -> AsyncIterator[Callable[[], Awaitable[Receiver]]]:
    made: list[Receiver] = []

    async def make() -> Receiver:
        r = await Receiver().start()
        made.append(r)
        return r

    yield make
    for r in made:
        await r.stop()


@pytest.fixture
async def bus(nats_server: NatsServer, prefix: str) -> AsyncIterator[Bus]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    subjects = Subjects(prefix)
    buckets = await ensure_all(js, subjects)
    yield Bus(nc, js, subjects, buckets)
    await nc.close()
