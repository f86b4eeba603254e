"""Fake agents: publish what a real agent publishes (inventory, heartbeats, shard status) on the real
subjects, with no engine behind them. For control-plane, console and operator tests that need a fleet
of many nodes; tests of the agent itself run the real one."""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.messages import (
    Assignment,
    GpuInfo,
    Heartbeat,
    Inventory,
    ShardReport,
    ShardState,
    ShardStatus,
)
from llmgw_common.subjects import Subjects


def fake_gpus(
    node: str, n: int, gpu_class: str, unhealthy: dict[int, str] | None = None
) -> tuple[GpuInfo, ...]:
    """``n`` cards of one class; ``unhealthy`` maps an index to the reason it is out."""
    bad = unhealthy or {}
    return tuple(
        GpuInfo(
            index=i,
            uuid=f"GPU-{node}-{i}",
            name=gpu_class,
            gpu_class=gpu_class,
            memory_mb=81559,
            healthy=i not in bad,
            reasons=(bad[i],) if i in bad else (),
        )
        for i in range(n)
    )


class FakeAgent:
    """One node's agent: its inventory, a heartbeat carrying its shards, shard status reports.

    Pass ``inventory`` to publish a given one; otherwise one is built from ``gpus``, ``gpu_class``,
    ``fabric``, ``memory_gb`` and ``unhealthy``.
    """

    def __init__(
        self,
        nc: NATS,
        prefix: str,
        node: str,
        *,
        inventory: Inventory | None = None,
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
        self.inventory = inventory or Inventory(
            node=node,
            boot_id=boot_id,
            sent_at=time.time(),
            fabric=fabric,
            memory_gb=memory_gb,
            cpus=32,
            engines=("sim", "vllm", "llamacpp"),
            gpus=fake_gpus(node, gpus, gpu_class, unhealthy),
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

    def serve(self, assignment: Assignment | None) -> None:
        """Report every shard of ``assignment`` ready from the next heartbeat on (and nothing else)."""
        self.shards = {
            (s.replica_id, s.shard): ShardReport(
                replica_id=s.replica_id, shard=s.shard, model=s.model, state=ShardState.READY, port=s.port
            )
            for s in (assignment.shards if assignment else ())
        }

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
        """Set one shard's state for later heartbeats and publish its status now."""
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
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
