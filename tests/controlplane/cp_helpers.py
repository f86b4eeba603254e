"""Control-plane test helpers: fake agents that publish real messages on real subjects, and a control
plane running in-process against the session's real nats-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS

from llmgw_common import bus
from llmgw_common.catalog import parse_catalog
from llmgw_common.codec import encode
from llmgw_common.ctl import CtlClient, CtlUnavailable, StatusReply
from llmgw_common.messages import (
    GpuInfo,
    Heartbeat,
    Inventory,
    ShardReport,
    ShardState,
    ShardStatus,
)
from llmgw_common.settings import ControlPlaneSettings
from llmgw_common.subjects import Subjects
from llmgw_controlplane.service import ControlPlane

CATALOG = """
models:
  - name: small
    engine: sim
    replicas: 1
    gpu_class: H100-80GB
  - name: cpu-model
    engine: sim
    replicas: 1
"""


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 10.0, every: float = 0.05) -> Any:
    """Poll ``check`` until it returns a truthy value; fail with its last value at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s (last: {last!r})")


# A ctl call's time limit in tests that make several at once: each endpoint's handler runs one request
# at a time (nats.micro) and a write verb does two JetStream round trips (read, compare-and-set), which
# on a loaded 2-core box take up to about half a second each: five queued cordons outlast ctl's 2 s.
CTL_TIMEOUT_S = 30.0


async def ctl_answers(nc: NATS, prefix: str, timeout: float = 15.0) -> StatusReply:
    """Poll ``ctl status`` until a leading control plane answers it, and return that answer.

    Wait on this, not on ``cp.leader``, before a ctl call: the flag flips before the ctl endpoints are
    registered (``_become_leader``), so a call right after it may meet "no responders" (``CtlUnavailable``).
    """

    async def answered() -> StatusReply | None:
        try:
            st = await CtlClient(nc, prefix, timeout=1.0).status()
        except CtlUnavailable:
            return None
        return st if st.leader else None

    got: StatusReply = await eventually(answered, timeout=timeout)
    return got


class FakeAgent:
    """Publishes what an agent publishes: inventory, heartbeats with its shards, shard status."""

    def __init__(
        self,
        nc: NATS,
        prefix: str,
        node: str,
        *,
        gpus: int = 8,
        gpu_class: str = "H100-80GB",
        fabric: str | None = "ib-a",
        boot_id: str = "boot-1",
        memory_gb: float | None = 512.0,
        unhealthy: dict[int, str] | None = None,
    ) -> None:
        self.nc = nc
        self.subjects = Subjects(prefix)
        self.node = node
        self.boot_id = boot_id
        self.seq = 0
        self.shards: dict[tuple[str, int], ShardReport] = {}
        bad = unhealthy or {}
        self.inventory = Inventory(
            node=node,
            boot_id=boot_id,
            sent_at=time.time(),
            fabric=fabric,
            memory_gb=memory_gb,
            cpus=32,
            engines=("sim", "vllm", "llamacpp"),
            gpus=tuple(
                GpuInfo(
                    index=i,
                    uuid=f"GPU-{node}-{i}",
                    name=gpu_class,
                    gpu_class=gpu_class,
                    memory_mb=81559,
                    healthy=i not in bad,
                    reasons=(bad[i],) if i in bad else (),
                )
                for i in range(gpus)
            ),
        )

    async def send_inventory(self) -> None:
        inv = self.inventory.model_copy(update={"boot_id": self.boot_id, "sent_at": time.time()})
        await self.nc.publish(self.subjects.inventory(self.node), encode(inv))

    async def beat(self) -> None:
        self.seq += 1
        hb = Heartbeat(
            node=self.node,
            boot_id=self.boot_id,
            seq=self.seq,
            sent_at=time.time(),
            shards=tuple(self.shards.values()),
        )
        await self.nc.publish(self.subjects.heartbeat(self.node), encode(hb))

    async def report(
        self,
        replica_id: str,
        shard: int,
        model: str,
        state: ShardState,
        port: int | None,
        error: str | None = None,
        log_tail: tuple[str, ...] = (),
    ) -> None:
        self.shards[(replica_id, shard)] = ShardReport(
            replica_id=replica_id, shard=shard, model=model, state=state, port=port, error=error
        )
        st = ShardStatus(
            node=self.node,
            boot_id=self.boot_id,
            sent_at=time.time(),
            replica_id=replica_id,
            shard=shard,
            model=model,
            state=state,
            port=port,
            error=error,
            log_tail=log_tail,
        )
        await self.nc.publish(self.subjects.status(self.node), encode(st))


class Beating:
    """Keeps a set of fake agents heartbeating every ``interval`` until stopped."""

    def __init__(self, agents: list[FakeAgent], interval: float) -> None:
        self.agents = agents
        self.interval = interval
        self.paused: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            for a in self.agents:
                if a.node not in self.paused:
                    await a.beat()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


def cp_settings(url: str, prefix: str, **over: Any) -> ControlPlaneSettings:
    base: dict[str, Any] = dict(
        nats_urls=[url],
        prefix=prefix,
        tick_s=0.1,
        heartbeat_interval_s=0.2,
        unreachable_after_missed=3,
        node_lost_s=1.5,
        settle_s=0.0,
        lease_ttl_s=1.5,
        admin_port=0,
    )
    base.update(over)
    return ControlPlaneSettings(**base)


class RunningCP:
    def __init__(self, cp: ControlPlane, stop: asyncio.Event, task: asyncio.Task[None], nc: NATS) -> None:
        self.cp = cp
        self.stop_event = stop
        self.task = task
        self.nc = nc

    async def stop(self) -> None:
        self.stop_event.set()
        await self.task
        await self.nc.close()


async def start_cp(
    settings: ControlPlaneSettings,
    catalog_text: str | None = CATALOG,
    holder: str | None = None,
    nc_url: str | None = None,
) -> RunningCP:
    nc = await bus.connect(settings, "cp-test", wait=False)
    cp = ControlPlane(settings, nc, holder=holder)
    if catalog_text is not None and settings.catalog_file is None:
        # Seed the bus with the catalog, as a previous run would have stored it.
        js = nc.jetstream()
        subj = Subjects(settings.prefix)
        kv = await bus.ensure_kv(js, subj.bucket_desired, history=5)
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            await kv.create("catalog", encode(parse_catalog(catalog_text)))
        except KeyWrongLastSequenceError:
            pass
    await cp.start()
    stop = asyncio.Event()
    task = asyncio.create_task(cp.run(stop))
    return RunningCP(cp, stop, task, nc)
