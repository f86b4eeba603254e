"""A simulated fleet for the operator tests: one coroutine publishes what hundreds of agents would.

Every node's Inventory and Heartbeat are real messages on the real subjects; the fleet reads its
assignments from the ``<prefix>_assign`` bucket's subjects and reports the assigned shards ready in the
next heartbeats, as an agent whose engines start instantly would. The fleet is varied on purpose:
several fabrics and GPU classes, unhealthy GPUs with reasons, nodes without a memory figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.messages import Assignment, Heartbeat, Inventory, ShardReport, ShardState
from llmgw_common.router_messages import IdleReport
from llmgw_common.subjects import Subjects
from llmgw_runtime.bus import flush
from tests.kit.agents import fake_gpus

# (GPU class, cards per node) by node index modulo 10: 6 of 10 nodes H100, 3 A100, 1 L4.
SHAPES = (
    ("H100-80GB", 8),
    ("H100-80GB", 8),
    ("A100-40GB", 8),
    ("H100-80GB", 8),
    ("A100-40GB", 4),
    ("H100-80GB", 8),
    ("L4-24GB", 4),
    ("H100-80GB", 8),
    ("A100-40GB", 8),
    ("H100-80GB", 8),
)
FABRICS = ("ib-a", "ib-b", "ib-c", "roce-d")

# A catalog that places some replicas of several shapes and holds one model nobody can place.
CATALOG = """\
models:
  - name: chat-h100
    engine: sim
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: 12
  - name: big-h100
    engine: sim
    gpu_class: H100-80GB
    gpus_per_node: 8
    nodes: 2
    replicas: 2
  - name: mid-a100
    engine: sim
    gpu_class: A100-40GB
    gpus_per_node: 4
    replicas: 5
  - name: small-l4
    engine: sim
    gpu_class: L4-24GB
    gpus_per_node: 2
    replicas: 6
  - name: cpu-embed
    engine: sim
    replicas: 3
  - name: future-b200
    engine: sim
    gpu_class: B200-192GB
    gpus_per_node: 8
    replicas: 1
""" + "".join(
    f"  - {{name: huge-{k}, engine: sim, gpu_class: H100-80GB, gpus_per_node: 8, nodes: 60, replicas: 1}}\n"
    for k in range(8)
)


def node_name(i: int) -> str:
    return f"node-{i:03d}"


def fabric_of(i: int) -> str | None:
    # Every 25th node has no fabric reported (shown as "-").
    return None if i % 25 == 24 else FABRICS[i % len(FABRICS)]


def unhealthy_of(i: int) -> dict[int, str]:
    """GPU index -> reason, for the nodes with bad cards (one in seven; two bad cards on one in 21)."""
    if i % 7 != 3:
        return {}
    bad = {1: "XID 79 seen (GPU fell off the bus)"}
    if i % 21 == 3:
        bad[2] = "uncorrectable ECC errors: 3"
    return bad


def memory_of(i: int) -> float | None:
    # One node in eleven could not read MemTotal: not a small node, just unknown (#3).
    return None if i % 11 == 5 else 1024.0


@dataclass
class Fleet:
    nc: NATS
    prefix: str
    n: int
    boot: str = "boot-1"
    seq: int = 0
    shards: dict[str, tuple[ShardReport, ...]] = field(default_factory=dict)
    assignments: int = 0
    # When set: a router "r-fleet" reports replicas of these models used just now, every beat.
    used_models: set[str] | None = None
    # That router's start, fixed as a real router's is (a new one would be a restart), an hour ago.
    router_since: float = field(default_factory=lambda: time.time() - 3600)
    _task: asyncio.Task[None] | None = None

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    def inventory(self, i: int) -> Inventory:
        name = node_name(i)
        gpu_class, count = SHAPES[i % len(SHAPES)]
        bad = unhealthy_of(i)
        return Inventory(
            node=name,
            boot_id=self.boot,
            sent_at=time.time(),
            fabric=fabric_of(i),
            memory_gb=memory_of(i),
            cpus=64,
            engines=("sim", "vllm", "llamacpp"),
            simulated=True,
            labels={"rack": f"r{i // 20:02d}"},
            gpus=fake_gpus(name, count, gpu_class, bad),
        )

    async def start(self) -> None:
        await self.nc.subscribe(f"$KV.{self.subjects.bucket_assign}.>", cb=self._on_assign)
        await flush(self.nc)
        for i in range(self.n):
            await self.nc.publish(self.subjects.inventory(node_name(i)), encode(self.inventory(i)))
        await flush(self.nc)
        self._task = asyncio.create_task(self._beat_forever(), name="fleet-heartbeats")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _on_assign(self, msg: Msg) -> None:
        try:
            a = decode(msg.data, Assignment)
        except DecodeError:
            return  # a delete marker has no body
        self.assignments += 1
        self.shards[a.node] = tuple(
            ShardReport(
                replica_id=s.replica_id,
                shard=s.shard,
                model=s.model,
                state=ShardState.READY,
                port=s.port,
                pid=100000 + s.port,
                since=time.time(),
            )
            for s in a.shards
        )

    async def beat_once(self) -> None:
        self.seq += 1
        for i in range(self.n):
            name = node_name(i)
            hb = Heartbeat(
                node=name,
                boot_id=self.boot,
                seq=self.seq,
                sent_at=time.time(),
                shards=self.shards.get(name, ()),
            )
            await self.nc.publish(self.subjects.heartbeat(name), encode(hb))
        if self.used_models is not None:
            now = time.time()
            used = {
                s.replica_id: now
                for shards in self.shards.values()
                for s in shards
                if s.model in self.used_models
            }
            rep = IdleReport(router="r-fleet", since=self.router_since, sent_at=now, last_used=used)
            await self.nc.publish(self.subjects.idle("r-fleet"), encode(rep))
        await flush(self.nc)

    async def _beat_forever(self, interval: float = 0.5) -> None:
        while True:
            t0 = time.monotonic()
            await self.beat_once()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))
