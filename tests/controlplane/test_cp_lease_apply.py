"""Leader lease (take, renew, takeover, fencing) and the writers that only write what changed."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from llmgw_common.catalog import Catalog, parse_catalog
from llmgw_common.codec import decode, encode
from llmgw_common.ctl import LeaseRecord
from llmgw_common.messages import Assignment, ReplicaRecord, ReplicaSpec, ShardAssignment, ShardPlacement
from llmgw_common.subjects import LEADER_KEY, Subjects
from llmgw_controlplane.apply import AssignmentWriter, Fenced, ReplicaStore, desired_assignments, pin_specs
from llmgw_controlplane.leader import Lease
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient, CtlUnavailable
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _leader_kv(nc: NATS, prefix: str, ttl: float = 30.0) -> KeyValue:
    return await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_leader, ttl=ttl)


async def test_lease_take_renew_takeover_and_deposed_cannot_confirm(bus_nc: NATS, prefix: str) -> None:
    kv = await _leader_kv(bus_nc, prefix)
    ca, cb = Clock(), Clock()
    a = Lease(kv, "a", ttl_s=10.0, clock=ca)
    b = Lease(kv, "b", ttl_s=10.0, clock=cb)
    assert await a.step()
    f1 = a.fence
    assert not await b.step()  # held by a: b only watches the revision
    ca.t += 3
    assert await a.step()  # renewed: a new, larger revision
    assert a.fence > f1
    cb.t += 9
    assert not await b.step()  # the revision moved: the clock restarts for b
    cb.t += 9.9
    assert not await b.step()
    # a stops renewing (hung, partitioned). After a whole TTL of no change by b's own clock, b takes it.
    cb.t += 10.1
    assert await b.step()
    assert b.fence > a.fence
    # a wakes up: its renewal fails on the revision; it is deposed and knows it.
    ca.t += 1
    assert not await a.confirm()
    assert not a.held()
    # a holder that cannot renew stops counting itself leader before a standby could take over
    assert b.held()
    cb.t += 8.1
    assert not b.held()


async def test_released_lease_is_taken_at_once(bus_nc: NATS, prefix: str) -> None:
    kv = await _leader_kv(bus_nc, prefix)
    a = Lease(kv, "a", ttl_s=10.0)
    b = Lease(kv, "b", ttl_s=10.0)
    assert await a.step()
    await a.release()
    assert await b.step()
    assert b.fence > a.fence


async def test_assignment_writer_writes_only_what_changed_and_is_fenced(bus_nc: NATS, prefix: str) -> None:
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_assign)
    drops = bus.DropLog(logging.getLogger("t"))
    w = AssignmentWriter(kv, drops)
    cat = parse_catalog("models: [{name: m, engine: sim, gpu_class: H100}, {name: c, engine: sim}]")
    recs = {
        "r1": ReplicaRecord(
            id="r1",
            model="m",
            created=1.0,
            shards=(ShardPlacement(shard=0, node="a", gpus=(0,), port=20001),),
        ),
        "r2": ReplicaRecord(
            id="r2", model="c", created=1.0, shards=(ShardPlacement(shard=0, node="b", port=20002),)
        ),
    }
    desired = desired_assignments(recs, cat, {"a": "10.0.0.1", "b": "10.0.0.2"})
    assert set(w.pending(desired)) == {"a", "b"}
    for n, sh in w.pending(desired).items():
        await w.write(n, sh, fence=7, now=5.0)
    assert w.writes == 2
    assert w.pending(desired) == {}
    got, _ = await bus.kv_get(kv, "a", Assignment)
    assert got is not None and got.fence == 7 and got.shards[0].replica_id == "r1"
    # One replica moves away from b: only b is written (with no shards), a is untouched.
    desired2 = desired_assignments({"r1": recs["r1"]}, cat, {"a": "10.0.0.1"})
    assert w.pending(desired2) == {"b": ()}
    # A reader that starts afresh (a restarted control plane) diffs against what is there.
    w2 = AssignmentWriter(kv, drops)
    loaded = await w2.load()
    assert set(loaded) == {"a", "b"} and w2.pending(desired) == {}
    # Someone else (a new leader) writes b: the old writer's write is refused, not landed.
    await w2.write("b", (), fence=9, now=6.0)
    with pytest.raises(Fenced):
        await w.write("b", desired2.get("b", ()), fence=7, now=6.0)
    after, _ = await bus.kv_get(kv, "b", Assignment)
    assert after is not None and after.fence == 9


async def test_replica_store_syncs_puts_and_deletes(bus_nc: NATS, prefix: str) -> None:
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_replicas)
    drops = bus.DropLog(logging.getLogger("t"))
    s = ReplicaStore(kv, drops)
    r1 = ReplicaRecord(id="r1", model="m", created=1.0, shards=(ShardPlacement(shard=0, node="a", port=1),))
    r2 = r1.model_copy(update={"id": "r2"})
    assert await s.sync({"r1": r1, "r2": r2}) == 2
    assert await s.sync({"r1": r1, "r2": r2}) == 0
    assert await s.sync({"r1": r1}) == 1
    assert set(await ReplicaStore(kv, drops).load()) == {"r1"}
    # A takeover lists the keys from the stream's leader: a stopped replica leaves nothing to list
    # (a delete marker would be listed and read once more at every takeover, for ever).
    assert await bus.leader_reads(kv).keys() == ["r1"]


def test_multi_node_assignment_names_the_leader_address() -> None:
    cat = parse_catalog("models: [{name: big, engine: sim, gpu_class: H100, gpus_per_node: 8, nodes: 2}]")
    rec = ReplicaRecord(
        id="r",
        model="big",
        created=0.0,
        shards=(
            ShardPlacement(shard=1, node="b", gpus=tuple(range(8)), port=20002),
            ShardPlacement(shard=0, node="a", gpus=tuple(range(8)), port=20001),
        ),
    )
    d = desired_assignments({"r": rec}, cat, {"a": "10.0.0.1", "b": "10.0.0.2"})
    sa: ShardAssignment = d["b"][0]
    assert (sa.shard, sa.shards, sa.leader, sa.engine) == (1, 2, "10.0.0.1:20001", "sim")
    # A replica whose model left the catalog gets no assignment lines: it is torn down.
    assert desired_assignments({"r": rec}, parse_catalog("models: []"), {}) == {}


def test_a_running_replica_keeps_the_spec_it_was_started_with() -> None:
    """A profile change never rewrites a running replica's assignment (the reconciler rolls it instead);
    a record without a spec is pinned to the catalog of the day, which is what its assignment held."""
    old = parse_catalog(
        "models: [{name: m, engine: sim, args: [--len, '4096'], options: {slots: 4, x: [1, 2.5]}}]"
    )
    new = parse_catalog("models: [{name: m, engine: sim, args: [--len, '8192'], options: {slots: 8}}]")
    bare = ReplicaRecord(
        id="r", model="m", created=0.0, shards=(ShardPlacement(shard=0, node="a", port=20001),)
    )
    (rec,) = pin_specs({"r": bare}, old).values()
    assert rec.spec == ReplicaSpec.of(old.models[0])
    before = desired_assignments({"r": rec}, old, {})
    assert before["a"][0].args == ("--len", "4096")
    assert desired_assignments({"r": rec}, new, {}) == before
    assert pin_specs({"r": rec}, new) == {"r": rec}  # a pinned record stays pinned
    # Read back from the bucket (a restart), the spec still matches its unchanged profile: no roll.
    back = decode(encode(rec), ReplicaRecord)
    assert back.spec is not None and back.spec.matches(decode(encode(old), Catalog).models[0])
    assert not back.spec.matches(new.models[0])


async def test_deposed_leader_writes_nothing(nats_server: NatsServer, prefix: str, bus_nc: NATS) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix, lease_ttl_s=30.0))
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    try:
        await eventually(lambda: run.cp.leader, what="the control plane to lead")
        # Another control plane takes the lease (its write moves the revision).
        kv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_leader)
        await kv.put(LEADER_KEY, encode(LeaseRecord(holder="usurper", acquired_at=1.0, renewed_at=1.0)))
        # News arrives that would make the old leader place a replica.
        await agent.send_inventory()
        await agent.beat()
        await eventually(lambda: not run.cp.leader, what="the old leader to see it is deposed")
        akv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_assign)
        assert await bus.kv_keys(akv) == []
        # And it no longer answers ctl requests.
        with pytest.raises(CtlUnavailable, match="no control plane answered"):
            await CtlClient(bus_nc, prefix, timeout=0.5).nodes()
    finally:
        await run.stop()


@pytest.mark.slow
async def test_standby_takes_over_adopts_and_places_nothing_twice(
    nats_server: NatsServer, prefix: str, bus_nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = cp_settings(nats_server.url, prefix, lease_ttl_s=1.0)
    a = await start_cp(s, holder="a")
    await eventually(lambda: a.cp.leader, what="a to lead")
    b = await start_cp(s, holder="b", catalog_text=None)
    agents = [FakeAgent(bus_nc, prefix, f"gpu-{i}") for i in range(2)]
    beating = Beating(agents, 0.1)
    try:
        for ag in agents:
            await ag.send_inventory()
        beating.start()
        akv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_assign)

        async def placed() -> dict[str, Assignment] | None:
            out: dict[str, Assignment] = {}
            for k in await bus.kv_keys(akv):
                x, _ = await bus.kv_get(akv, k, Assignment)
                if x and x.shards:
                    out[k] = x
            return out if sum(len(x.shards) for x in out.values()) == 2 else None

        before = await eventually(placed, what="both replicas assigned")
        assert before is not None
        assert not b.cp.leader
        ids_before = sorted(sh.replica_id for x in before.values() for sh in x.shards)

        # a dies without releasing the lease (as under SIGKILL): its loops stop, its lease lapses.
        async def cannot_release() -> None:
            pass

        monkeypatch.setattr(a.cp.lease, "release", cannot_release)
        a.stop_event.set()
        await a.task
        t0 = asyncio.get_running_loop().time()
        await eventually(
            lambda: b.cp.leader and b.cp.passes > 0, timeout=10, what="b to take over and reconcile"
        )
        took = asyncio.get_running_loop().time() - t0
        assert took < 2 * 1.0 + 1.0  # two lease periods, plus one renew interval of slack
        writes = b.cp.assignments.writes
        await eventually(lambda: b.cp.passes > 5, what="five passes by b")
        after = await placed()
        assert after is not None
        ids_after = sorted(sh.replica_id for x in after.values() for sh in x.shards)
        assert ids_after == ids_before  # adopted, nothing placed twice
        assert b.cp.assignments.writes == writes  # nothing rewritten
        assert all(x.fence < b.cp.lease.fence for x in after.values())
    finally:
        await beating.stop()
        await b.stop()
        await a.stop()
