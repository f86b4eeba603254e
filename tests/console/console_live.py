"""Live-console helpers: fake agents publishing real Heartbeat/Inventory on real subjects, polling."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.ctl import CtlClient
from llmgw_common.messages import (
    Assignment,
    GpuInfo,
    Heartbeat,
    Inventory,
    ShardReport,
    ShardState,
    StorageReport,
    UsageReport,
    WeightsEntry,
)
from llmgw_common.subjects import Subjects
from llmgw_controlplane.service import ControlPlane

DEPS_REASON = "install chromium and playwright: make console-deps"
LIVE_CATALOG = """
models:
  - name: llama-8b
    engine: sim
    replicas: 1
    gpu_class: H100-80GB
    gpus_per_node: 2
  - name: qwen-cpu
    engine: sim
    replicas: 1
  - name: giant
    engine: sim
    replicas: 1
    gpu_class: B200-192GB
    gpus_per_node: 8
"""
LIVE_UNHEALTHY = "XID 79 (fell off the bus)"


def chromium_path() -> str | None:
    return os.environ.get("LLMGW_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


class FakeAgent:
    """Publishes what an agent publishes; reports every shard assigned to it as ready (no engine)."""

    def __init__(self, nc: NATS, prefix: str, node: str, inventory: Inventory) -> None:
        self.nc = nc
        self.subjects = Subjects(prefix)
        self.node = node
        self.inventory = inventory
        self.seq = 0

    async def beat(self, assignment: Assignment | None) -> None:
        self.seq += 1
        shards = tuple(
            ShardReport(
                replica_id=s.replica_id, shard=s.shard, model=s.model, state=ShardState.READY, port=s.port
            )
            for s in (assignment.shards if assignment else ())
        )
        hb = Heartbeat(node=self.node, boot_id="boot-1", seq=self.seq, sent_at=time.time(), shards=shards)
        await self.nc.publish(self.subjects.heartbeat(self.node), encode(hb))

    async def send_inventory(self) -> None:
        inv = self.inventory.model_copy(update={"sent_at": time.time()})
        await self.nc.publish(self.subjects.inventory(self.node), encode(inv))


def _gpus(node: str, n: int, cls: str, bad: dict[int, str] | None = None) -> tuple[GpuInfo, ...]:
    bad = bad or {}
    return tuple(
        GpuInfo(
            index=i,
            uuid=f"GPU-{node}-{i}",
            name=cls,
            gpu_class=cls,
            memory_mb=81559,
            healthy=i not in bad,
            reasons=(bad[i],) if i in bad else (),
        )
        for i in range(n)
    )


def live_agents(nc: NATS, prefix: str) -> list[FakeAgent]:
    shared = StorageReport(
        looked=True,
        weights=(
            WeightsEntry(name="llama-8b", path="/models/llama-8b", shared=True, filer_id="filer1:/models"),
        ),
    )
    inv = [
        Inventory(
            node="h100-01",
            boot_id="boot-1",
            sent_at=0,
            gpus=_gpus("h100-01", 8, "H100-80GB", {7: LIVE_UNHEALTHY}),
            memory_gb=1024.0,
            cpus=96,
            fabric="ib-a",
            labels={"rack": "a1"},
            engines=("sim",),
            storage=shared,
        ),
        Inventory(
            node="h100-02",
            boot_id="boot-1",
            sent_at=0,
            gpus=_gpus("h100-02", 8, "H100-80GB"),
            memory_gb=1024.0,
            cpus=96,
            fabric="ib-a",
            engines=("sim",),
            storage=shared,
        ),
        Inventory(
            node="a100-01",
            boot_id="boot-1",
            sent_at=0,
            gpus=_gpus("a100-01", 4, "A100-40GB"),
            memory_gb=None,
            cpus=48,
            fabric="ib-b",
            engines=("sim",),
        ),
        Inventory(node="cpu-01", boot_id="boot-1", sent_at=0, memory_gb=256.0, cpus=64, engines=("sim",)),
    ]
    return [FakeAgent(nc, prefix, i.node, i) for i in inv]


@dataclass
class LiveConsole:
    url: str
    cp: ControlPlane
    ctl: CtlClient
    nc: NATS
    prefix: str
    agents: list[FakeAgent]

    async def publish_usage(self, report: UsageReport) -> None:
        await self.nc.publish(Subjects(self.prefix).usage(report.router), encode(report))
        await self.nc.flush()


async def eventually(check: Any, timeout: float = 10.0, every: float = 0.05) -> Any:
    """Poll the async ``check`` until it returns a truthy value; fail with its last value at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s (last: {last!r})")
