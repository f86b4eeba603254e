from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS


@pytest.fixture
async def bus_nc(nats_server: Any) -> AsyncIterator[NATS]:
    import nats

    nc = await nats.connect(nats_server.url)
    yield nc
    await nc.close()
