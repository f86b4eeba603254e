"""LoRA adapters through the real nats-server (issue 33): a fake agent reports its replica and the
adapters it has loaded on the real subjects, a fake router wakes adapters, the control plane runs
in-process and writes the adapters into shard 0's assignment; ctl shows them; a new control plane
starts from the stored assignment."""

from __future__ import annotations

import time

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import decode, encode
from llmgw_common.messages import Assignment, LoadReport, ReplicaLoad
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.controlplane.test_cp_wake import ready_all
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually

CATALOG = """
models:
  - {name: base, engine: sim, replicas: 1, max_loras: 2}
adapters:
  - {name: a1, base: base, weights: w-a1}
  - {name: a2, base: base, weights: w-a2}
  - {name: a3, base: base, weights: w-a3}
"""


async def _wake(nc: NATS, prefix: str, model: str) -> WakeReply:
    req = WakeRequest(model=model, router="r1", sent_at=time.time())
    msg = await nc.request(Subjects(prefix).wake("r1"), encode(req), timeout=5)
    return decode(msg.data, WakeReply)


async def _asked(nc: NATS, prefix: str, node: str) -> tuple[str, ...] | None:
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_assign)
    a, _ = await bus.kv_get(kv, node, Assignment)
    if a is None or not a.shards:
        return None
    return tuple(x.name for x in a.shards[0].adapters)


async def _report(nc: NATS, prefix: str, rid: str, **kw: object) -> None:
    rep = LoadReport(node="n1", sent_at=time.time(), replicas=(ReplicaLoad(replica_id=rid, **kw),))  # type: ignore[arg-type]
    await nc.publish(Subjects(prefix).load("n1"), encode(rep))


@pytest.mark.slow
@pytest.mark.e2e
async def test_adapters_are_loaded_where_asked_let_go_by_lru_never_busy_and_refused_with_their_error(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    settings = cp_settings(nats_server.url, prefix, adapter_min_residency_s=0.0)
    run = await start_cp(settings, CATALOG)
    agent = FakeAgent(bus_nc, prefix, "n1", gpus=0, memory_gb=None)
    beating = Beating([agent], 0.1)
    try:
        await agent.send_inventory()
        beating.start()
        await eventually(lambda: run.cp.state.replicas or None, what="the base placed")
        await ready_all(run.cp, agent)
        (rid,) = list(run.cp.state.replicas)

        async def asked(want: tuple[str, ...]) -> bool | None:
            return await _asked(bus_nc, prefix, "n1") == want or None

        await eventually(lambda: asked(()), what="the replica assigned, with no adapter")

        # Asked for: written on shard 0; serving once the agent reports it loaded.
        w = await _wake(bus_nc, prefix, "a1")
        assert (w.state, w.reason) == (WakeState.WAKING, "loading on a replica of base")

        await eventually(lambda: asked(("a1",)), what="a1 asked of the replica")
        await _report(bus_nc, prefix, rid, adapters=("a1",))
        await eventually(
            lambda: _serving(bus_nc, prefix, "a1"), what="a1 serving once reported loaded", timeout=15
        )

        # A second fills the replica's slots; a third lets go the least recently used that is not busy.
        await _wake(bus_nc, prefix, "a2")
        await eventually(lambda: asked(("a1", "a2")), what="a2 asked too")
        await _report(bus_nc, prefix, rid, adapters=("a1", "a2"), adapters_busy=("a1",))
        await eventually(lambda: _serving(bus_nc, prefix, "a2"), what="a2 serving", timeout=15)
        # a1 was asked for first, but requests run on it: a2 goes.
        w3 = await _wake(bus_nc, prefix, "a3")
        assert w3.state is WakeState.WAKING
        await eventually(lambda: asked(("a1", "a3")), what="a3 in place of a2, a1 kept (busy)")

        # a3's load fails on the only replica: refused with the engine's reason; ctl says it.
        err = "Loading lora a3 failed: No adapter found for w-a3"
        await _report(
            bus_nc, prefix, rid, adapters=("a1",), adapters_busy=("a1",), adapter_errors={"a3": err}
        )

        async def refused() -> WakeReply | None:
            r = await _wake(bus_nc, prefix, "a3")
            return r if r.state is WakeState.REFUSED else None

        r = await eventually(refused, what="a3 refused with its error", timeout=15)
        assert r.reason == f"adapter a3 could not be loaded on base base: {err} (replica {rid})"
        ctl = CtlClient(bus_nc, prefix, timeout=10)
        models = await ctl.models()
        info = {a.name: a for a in models.adapters}
        assert (info["a1"].state, info["a1"].loaded_on) == ("loaded", (rid,))
        assert info["a3"].state == "failed" and err in (info["a3"].reason or "")
        assert info["a2"].unloads == 1 and info["a3"].loads == 1
        reps = await ctl.replicas()
        assert reps.replicas[0].adapter_errors == {"a3": err}
        ex = await ctl.explain_placement("a3")
        assert not ex.placeable and ex.nodes[0].reasons == (f"its load failed: {err}",)

        # A new control plane (a takeover after a restart) starts from the stored assignment: nothing
        # is reloaded or let go.
        before = await _asked(bus_nc, prefix, "n1")
        await run.stop()
        run = await start_cp(settings, None)
        await eventually(lambda: run.cp.loop.passes >= 3 or None, what="the new leader passing", timeout=20)
        await _report(
            bus_nc, prefix, rid, adapters=("a1",), adapters_busy=("a1",), adapter_errors={"a3": err}
        )
        seen = run.cp.loop.passes
        await eventually(lambda: run.cp.loop.passes >= seen + 3 or None, what="passes after the report")
        assert before == ("a1", "a3") and await _asked(bus_nc, prefix, "n1") == before
    finally:
        await beating.stop()
        await run.stop()


async def _serving(nc: NATS, prefix: str, adapter: str) -> WakeReply | None:
    r = await _wake(nc, prefix, adapter)
    return r if r.state is WakeState.SERVING else None
