from __future__ import annotations

from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS

from llmgw_runtime.natsserver import NatsServer


@pytest.fixture
async def agent_nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    """The stand-in agents' own connection (the router's is ``nc``)."""
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()
