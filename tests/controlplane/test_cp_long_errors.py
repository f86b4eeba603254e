"""A shard error of any length from one node must not stop the routing table or the events of all.

The error a node reports reaches the model's crash-loop reason, and from there the routing table's
``unavailable`` text (one KV value for every model) and the model.down event. Kept whole, two models'
600 KB errors made every routing write exceed the server's max_payload: each pass failed to write, and
no model's endpoints changed again while the crash loop's backoff lasted (up to 5 minutes a time).
"""

from __future__ import annotations

from nats.aio.client import Client as NATS

from llmgw_common.messages import ShardAssignment, ShardState
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.controlplane.test_cp_e2e import _assignments, _endpoints
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually

CATALOG = """
models:
  - {name: a, engine: sim}
  - {name: b, engine: sim}
  - {name: c, engine: sim}
"""


async def test_huge_shard_errors_leave_routing_working_for_every_model(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    # A crash loop's backoff holds the long reason in the table for minutes: longer than this test.
    settings = cp_settings(nats_server.url, prefix, backoff_base_s=60.0)
    run = await start_cp(settings, catalog_text=CATALOG)
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    beating = Beating([agent], 0.1)
    try:
        await agent.send_inventory()
        beating.start()

        async def all_placed() -> dict[str, ShardAssignment] | None:
            got = await _assignments(bus_nc, prefix)
            shards = {s.model: s for a in got.values() for s in a.shards}
            return shards if len(shards) == 3 else None

        shards = await eventually(all_placed, what="a, b and c placed")
        assert shards is not None
        beating.paused.add("gpu-0")  # one heartbeat cannot carry both errors (1.2 MB): statuses do
        for m in ("a", "b"):
            s = shards[m]
            await agent.report(s.replica_id, 0, m, ShardState.FAILED, s.port, error=m.upper() * 600_000)

        def backing_off() -> bool:
            return {"a", "b"} <= set(run.cp.verdicts.backoff)

        await eventually(backing_off, timeout=1.0, what="a and b in crash-loop backoff")
        for key, rep in agent.shards.items():
            agent.shards[key] = rep.model_copy(update={"error": "long"})
        beating.paused.clear()
        await agent.report(shards["c"].replica_id, 0, "c", ShardState.READY, shards["c"].port)

        async def c_routed() -> bool:
            e = await _endpoints(bus_nc, prefix)
            return e is not None and "c" in e.endpoints

        await eventually(c_routed, what="c routed despite a and b's huge errors")
        e = await _endpoints(bus_nc, prefix)
        assert e is not None and {"a", "b"} <= set(e.unavailable)
        assert all(len(text) < 4000 for text in e.unavailable.values()), {
            m: len(t) for m, t in e.unavailable.items()
        }
    finally:
        await beating.stop()
        await run.stop()
