"""Every write of ``llmgw_desired`` is compare-and-set: concurrent verbs, and writers that are not this
control plane, never lose a mark or a catalog (issue 12 item 4)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue
from pydantic import BaseModel

from llmgw_common.catalog import Catalog, parse_catalog
from llmgw_common.codec import encode
from llmgw_common.messages import Marks
from llmgw_common.subjects import DESIRED_CATALOG, DESIRED_MARKS, Subjects
from llmgw_controlplane.desired import Changed, DesiredConflict, DesiredStore, cordon
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import CTL_TIMEOUT_S, RunningCP, cp_settings, ctl_answers, start_cp
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually

M = TypeVar("M", bound=BaseModel)

NODES = [f"gpu-{i}" for i in range(10)]

BIGGER = """
models:
  - name: small
    engine: sim
    replicas: 2
    gpu_class: H100-80GB
  - name: cpu-model
    engine: sim
    replicas: 1
"""


async def _stored_marks(nc: NATS, prefix: str) -> Marks:
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_desired)
    marks, _ = await bus.kv_get(kv, DESIRED_MARKS, Marks)
    return marks or Marks()


async def _fleet(bus_nc: NATS, prefix: str, run: RunningCP) -> Beating:
    agents = [FakeAgent(bus_nc, prefix, n) for n in NODES]
    beating = Beating(agents, 0.1)
    for a in agents:
        await a.send_inventory()
    beating.start()
    await eventually(
        lambda: run.cp.leader and set(NODES) <= set(run.cp.state.nodes),
        what="a leading control plane that knows every node",
    )
    await ctl_answers(bus_nc, prefix)
    return beating


@pytest.mark.slow
async def test_concurrent_cordon_drain_and_catalog_apply_keep_every_mark(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    # One client connection per request, as ten operators' `llmgw ctl` would be.
    clients = [await nats.connect(nats_server.url) for _ in NODES]
    beating = await _fleet(bus_nc, prefix, run)
    try:
        calls: list[Awaitable[object]] = []
        for i, (n, nc) in enumerate(zip(NODES, clients, strict=True)):
            c = CtlClient(nc, prefix, timeout=CTL_TIMEOUT_S)
            calls.append(c.cordon(n) if i % 2 == 0 else c.drain(n, grace_s=600))
        calls.append(CtlClient(clients[0], prefix, timeout=CTL_TIMEOUT_S).catalog_apply(BIGGER))
        await asyncio.gather(*calls)

        stored = await _stored_marks(bus_nc, prefix)
        assert set(stored.cordoned) == set(NODES[0::2])
        assert set(stored.draining) == set(NODES[1::2])
        assert run.cp.state.marks == stored  # what the reconciler acts on is what is stored
        shown = await CtlClient(bus_nc, prefix).catalog_show()
        small = shown.catalog.get("small")
        assert small is not None and small.replicas == 2

        # Undo them all at once: every node ends unmarked.
        await asyncio.gather(
            *(
                CtlClient(nc, prefix, timeout=CTL_TIMEOUT_S).uncordon(n)
                for n, nc in zip(NODES, clients, strict=True)
            )
        )
        assert await _stored_marks(bus_nc, prefix) == Marks()
    finally:
        await beating.stop()
        for nc in clients:
            await nc.close()
        await run.stop()


class FirstFinishesLast(DesiredStore):
    """The first change's verb is the last to resume after its write (as the scheduler may have it)."""

    def __init__(self, kv: KeyValue, drops: bus.DropLog) -> None:
        super().__init__(kv, drops)
        self.calls = 0
        self.second_done = asyncio.Event()

    async def change(self, key: str, cls: type[M], fn: Callable[[M | None], M]) -> Changed[M]:
        self.calls += 1
        first = self.calls == 1
        out = await super().change(key, cls, fn)
        if first:
            await self.second_done.wait()
        else:
            self.second_done.set()
        return out


async def test_verbs_finishing_out_of_order_leave_the_latest_marks_in_force(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    beating = await _fleet(bus_nc, prefix, run)
    run.cp.desired.store = FirstFinishesLast(run.cp.kv_desired, run.cp.drops)
    try:
        await asyncio.gather(
            CtlClient(bus_nc, prefix, timeout=CTL_TIMEOUT_S).cordon("gpu-0"),
            CtlClient(bus_nc, prefix, timeout=CTL_TIMEOUT_S).drain("gpu-1"),
        )
        stored = await _stored_marks(bus_nc, prefix)
        assert stored.cordoned == ("gpu-0",) and set(stored.draining) == {"gpu-1"}
        assert run.cp.state.marks == stored  # not the first verb's older value
    finally:
        await beating.stop()
        await run.stop()


async def test_a_mark_written_by_another_writer_survives_the_next_verb(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    """A deposed leader's in-flight verb (or any other writer) stored a mark this control plane never read:
    the next verb starts from the stored value, not from this process's memory."""
    run = await start_cp(cp_settings(nats_server.url, prefix))
    beating = await _fleet(bus_nc, prefix, run)
    kv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_desired)
    try:
        await kv.put(DESIRED_MARKS, encode(Marks(cordoned=("gpu-9",), draining={"gpu-8": 4e9})))
        ctl = CtlClient(bus_nc, prefix, timeout=CTL_TIMEOUT_S)
        r = await ctl.cordon("gpu-0")
        assert set(r.marks.cordoned) == {"gpu-0", "gpu-9"} and r.marks.draining == {"gpu-8": 4e9}
        stored = await _stored_marks(bus_nc, prefix)
        assert stored == r.marks and run.cp.state.marks == stored

        # The same for a catalog stored behind its back: the reply's diff is against what it replaced.
        await kv.put(DESIRED_CATALOG, encode(parse_catalog(BIGGER)))
        reply = await ctl.catalog_apply(BIGGER)
        assert reply.diff.empty
    finally:
        await beating.stop()
        await run.stop()


@pytest.mark.slow
async def test_standby_takes_over_with_every_mark(nats_server: NatsServer, prefix: str, bus_nc: NATS) -> None:
    """Two control planes: marks set through the first survive its death and marks set through the second."""
    s = cp_settings(nats_server.url, prefix)
    first = await start_cp(s, holder="cp-a")
    await eventually(lambda: first.cp.leader, what="cp-a to lead")
    second = await start_cp(s, holder="cp-b")
    beating = await _fleet(bus_nc, prefix, first)
    ctl = CtlClient(bus_nc, prefix, timeout=CTL_TIMEOUT_S)
    try:
        await asyncio.gather(*(ctl.cordon(n) for n in NODES[:5]))
        assert not second.cp.leader
        await first.stop()
        await eventually(lambda: second.cp.leader, timeout=15, what="cp-b to take over")
        await ctl_answers(bus_nc, prefix)  # its ctl endpoints are registered after the flag
        await asyncio.gather(*(ctl.cordon(n) for n in NODES[5:]))
        assert set((await _stored_marks(bus_nc, prefix)).cordoned) == set(NODES)
    finally:
        await beating.stop()
        await second.stop()


async def test_stored_catalog_unchanged_by_a_lost_race_at_startup(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    """A control plane starting with a catalog file never overwrites one already stored."""
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_desired, history=5)
    await kv.put(DESIRED_CATALOG, encode(parse_catalog(BIGGER)))
    run = await start_cp(cp_settings(nats_server.url, prefix))
    try:
        stored, _ = await bus.kv_get(kv, DESIRED_CATALOG, Catalog)
        assert stored == parse_catalog(BIGGER) == run.cp.state.catalog
    finally:
        await run.stop()


async def test_two_writers_racing_on_one_key_lose_nothing(bus_nc: NATS, prefix: str) -> None:
    """Two stores (two control planes' writers) interleaving forty changes: all forty land."""
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_desired, history=5)
    drops = bus.DropLog(logging.getLogger("test"))
    a, b = DesiredStore(kv, drops), DesiredStore(kv, drops)
    names = [f"n{i}" for i in range(40)]
    await asyncio.gather(
        *((a if i % 2 else b).change(DESIRED_MARKS, Marks, cordon(n)) for i, n in enumerate(names))
    )
    stored, _ = await bus.kv_get(kv, DESIRED_MARKS, Marks)
    assert stored is not None and set(stored.cordoned) == set(names)
    assert a.conflicts + b.conflicts > 0  # they did race


class SomeoneWritesAfterEveryRead(DesiredStore):
    """Another writer lands between every read and the write computed from it."""

    async def read(self, key: str, cls: type[M]) -> tuple[M | None, int]:
        got = await super().read(key, cls)
        await self.kv.put(DESIRED_MARKS, encode(Marks(cordoned=("other",))))
        return got


async def test_changes_of_one_writer_do_not_race_each_other(bus_nc: NATS, prefix: str) -> None:
    """Concurrent ctl verbs in one control plane take turns on a key instead of racing: with forty of
    them, one could lose every one of its attempts on a busy machine (the test above did, in debug mode)."""
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_desired, history=5)
    store = DesiredStore(kv, bus.DropLog(logging.getLogger("test")), attempts=1)
    names = [f"n{i}" for i in range(5)]
    await asyncio.gather(*(store.change(DESIRED_MARKS, Marks, cordon(n)) for n in names))
    stored, _ = await bus.kv_get(kv, DESIRED_MARKS, Marks)
    assert stored is not None and set(stored.cordoned) == set(names)
    assert store.conflicts == 0


async def test_a_writer_that_keeps_losing_gives_up_with_a_clear_error(bus_nc: NATS, prefix: str) -> None:
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_desired, history=5)
    store = SomeoneWritesAfterEveryRead(
        kv, bus.DropLog(logging.getLogger("test")), attempts=3, backoff_s=0.001
    )
    calls = 0

    def change(m: Marks | None) -> Marks:
        nonlocal calls
        calls += 1
        return cordon(f"n{calls}")(m)

    with pytest.raises(DesiredConflict, match=r"marks in .* changed under every one of 3 attempts"):
        await store.change(DESIRED_MARKS, Marks, change)
    assert calls == 3
    stored, _ = await bus.kv_get(kv, DESIRED_MARKS, Marks)
    assert stored == Marks(cordoned=("other",))  # nothing of ours landed
