from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from llmgw_runtime.natsserver import NatsServer


@pytest.fixture
async def bus_nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    import nats

    nc = await nats.connect(nats_server.url)
    yield nc
    await nc.close()
