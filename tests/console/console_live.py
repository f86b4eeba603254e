"""Live-console helpers: the fleet of fake agents the live console is fed by, and its catalog."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.messages import Inventory, StorageReport, WeightsEntry
from llmgw_common.router_messages import UsageReport
from llmgw_common.subjects import Subjects
from llmgw_controlplane.service import ControlPlane
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient
from tests.kit.agents import FakeAgent, fake_gpus

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
            gpus=fake_gpus("h100-01", 8, "H100-80GB", {7: LIVE_UNHEALTHY}),
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
            gpus=fake_gpus("h100-02", 8, "H100-80GB"),
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
            gpus=fake_gpus("a100-01", 4, "A100-40GB"),
            memory_gb=None,
            cpus=48,
            fabric="ib-b",
            engines=("sim",),
        ),
        Inventory(node="cpu-01", boot_id="boot-1", sent_at=0, memory_gb=256.0, cpus=64, engines=("sim",)),
    ]
    return [FakeAgent(nc, prefix, i.node, inventory=i) for i in inv]


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
        await bus.flush(self.nc)
