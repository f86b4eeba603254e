"""An alias bomb sent to the real control plane's ctl API is refused at once; the old catalog stays."""

from __future__ import annotations

import time

import pytest
from nats.aio.client import Client as NATS

from llmgw_runtime.ctl_client import CtlClient, CtlError
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, ctl_answers, start_cp

# The report's 1.2 KB catalog: nine levels of ten aliases in a model's options (10^9 nodes expanded).
BOMB = "models:\n  - name: tiny\n    engine: sim\n    options:\n      a0: &a0 [lol]\n" + "".join(
    f"      a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 10)
)


@pytest.mark.slow
async def test_alias_bomb_refused_fast_and_old_catalog_kept(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    assert len(BOMB) < 1300
    run = await start_cp(cp_settings(nats_server.url, prefix))
    # Two seconds is the ctl default; the unbounded loader took 13 s and 1.15 GB here.
    c = CtlClient(bus_nc, prefix, timeout=5.0)
    try:
        await ctl_answers(bus_nc, prefix)
        before = await c.catalog_show()
        for call in (c.catalog_apply, c.catalog_diff):
            t0 = time.perf_counter()
            with pytest.raises(
                CtlError, match="expands to more than 200000 nodes once its aliases are expanded"
            ):
                await call(BOMB)
            assert time.perf_counter() - t0 < 1.0
        after = await c.catalog_show()
        assert after.catalog == before.catalog and after.version == before.version
        assert run.cp.leader
    finally:
        await run.stop()
