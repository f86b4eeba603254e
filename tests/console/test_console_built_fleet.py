"""The console's numbers where the real ctl handlers compute them: a control plane's state (started, not
leading) is fed a fleet the test describes (cordoned, draining, lost, unhealthy), and each page's counts
are checked against that description, on a clock the test holds."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from llmgw_common.catalog import parse_catalog
from llmgw_common.messages import (
    GpuInfo,
    Heartbeat,
    Inventory,
    Marks,
    ReplicaRecord,
    ShardPlacement,
    ShardReport,
    ShardState,
)
from llmgw_controlplane.admin import CtlApiSource, build_admin_app
from llmgw_controlplane.service import ControlPlane
from llmgw_controlplane.settings import ControlPlaneSettings
from tests.console.console_fleet import NOW
from tests.console.console_pages import get, rows, text
from tests.kit.agents import fake_gpus


@dataclass(frozen=True)
class BuiltNode:
    name: str
    fabric: str | None
    gpus: tuple[GpuInfo, ...]
    used: tuple[int, ...] = ()  # GPUs its one replica holds
    heard_ago_s: float = 1.0
    cordoned: bool = False
    draining: bool = False


# Every case the overview must count differently: a partly used node with an unhealthy GPU, a cordoned
# idle node (its GPUs are held, not free), a draining busy one, a free one, a lost one (its idle GPUs are
# held too: counted, never free) and a node without GPUs.
BUILT = (
    BuiltNode("gpu-a01", "ib-a", fake_gpus("gpu-a01", 8, "H100-80GB", {7: "XID 79"}), used=(0, 1, 2, 3)),
    BuiltNode("gpu-a02", "ib-a", fake_gpus("gpu-a02", 8, "H100-80GB"), cordoned=True),
    BuiltNode("gpu-a03", "ib-a", fake_gpus("gpu-a03", 8, "H100-80GB"), used=tuple(range(8)), draining=True),
    BuiltNode("gpu-b01", "ib-b", fake_gpus("gpu-b01", 4, "A100-40GB")),
    BuiltNode("gpu-b02", "ib-b", fake_gpus("gpu-b02", 4, "A100-40GB"), heard_ago_s=1000.0),
    BuiltNode("cpu-01", None, ()),
)
BUILT_CATALOG = "models:\n  - name: m\n    engine: sim\n    replicas: 2\n    gpu_class: H100-80GB\n"


@pytest.fixture
async def built(nats_server: Any, nc: Any, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    """The console over the real ctl handlers of a control plane (started, not leading) whose state is
    fed the fleet above, on a clock the test holds."""
    s = ControlPlaneSettings(
        nats_urls=[nats_server.url], prefix=prefix, heartbeat_interval_s=2.0, node_lost_s=30.0
    )
    cp = ControlPlane(s, nc, clock=lambda: NOW)
    await cp.start()
    cp.state.set_catalog(parse_catalog(BUILT_CATALOG), 1)
    for n in BUILT:
        heard = NOW - n.heard_ago_s
        inv = Inventory(node=n.name, boot_id="b", sent_at=heard, gpus=n.gpus, fabric=n.fabric, cpus=8)
        cp.state.on_inventory(inv, heard)
        shards: tuple[ShardReport, ...] = ()
        if n.used:
            rid = f"r-{n.name}"
            cp.state.put_replica(
                ReplicaRecord(
                    id=rid,
                    model="m",
                    created=NOW - 60,
                    shards=(ShardPlacement(shard=0, node=n.name, gpus=n.used, port=20000),),
                )
            )
            shards = (ShardReport(replica_id=rid, shard=0, model="m", state=ShardState.READY, port=20000),)
        cp.state.on_heartbeat(Heartbeat(node=n.name, boot_id="b", seq=1, sent_at=heard, shards=shards), heard)
    cp.state.marks = Marks(
        cordoned=tuple(n.name for n in BUILT if n.cordoned),
        draining={n.name: NOW + 600 for n in BUILT if n.draining},
    )
    cp.state.judge(NOW)
    app = build_admin_app(CtlApiSource(cp.api), clock=lambda: NOW)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8081"
    ) as cl:
        yield cl


def _lost(n: BuiltNode) -> bool:
    return n.heard_ago_s > 30.0


async def test_overview_numbers_are_the_built_fleets(built: httpx.AsyncClient) -> None:
    """Computed here from the fleet's description, the way ARCHITECTURE says to count: unhealthy is
    neither used nor free (#2), idle GPUs of a cordoned, draining or lost node are held: they exist but
    are not capacity."""
    cap: dict[str, Counter[str]] = {}
    free_nodes: Counter[str] = Counter()
    for n in BUILT:
        for g in n.gpus:
            c = cap.setdefault(g.gpu_class, Counter())
            c["total"] += 1
            if not g.healthy:
                c["unhealthy"] += 1
            elif g.index in n.used:
                c["used"] += 1
            elif n.cordoned or n.draining or _lost(n):
                c["held"] += 1
            else:
                c["free"] += 1
        if n.gpus and not (_lost(n) or n.cordoned or n.draining or n.used):
            free_nodes[n.fabric or "-"] += 1
    page = await get(built, "/")
    assert rows(page, "capacity")[1:] == [
        f"{k} {v['used']} {v['free']} {v['unhealthy']} {v['held']} {v['total']}"
        for k, v in sorted(cap.items())
    ]
    assert rows(page, "free-nodes") == [f"{f} {k}" for f, k in sorted(free_nodes.items())]
    lost = sum(1 for n in BUILT if _lost(n))
    assert f"nodes lost {lost} ready {len(BUILT) - lost}" in text(page)


async def test_nodes_numbers_are_the_built_fleets(built: httpx.AsyncClient) -> None:
    page = await get(built, "/nodes")
    by_name = {r.split()[0]: r for r in rows(page, "nodes")[1:]}
    assert sorted(by_name) == sorted(n.name for n in BUILT)
    for n in BUILT:
        row = by_name[n.name]
        assert row.split()[1] == ("lost" if _lost(n) else "ready"), row
        if n.gpus:
            bad = sum(1 for g in n.gpus if not g.healthy)
            # used/free/held/unhealthy/total, the same count as the overview's: a cordoned, draining or
            # lost node's idle GPUs are held, never free.
            idle = len(n.gpus) - len(n.used) - bad
            held = n.cordoned or n.draining or _lost(n)
            free, kept = (0, idle) if held else (idle, 0)
            assert f"{len(n.used)}/{free}/{kept}/{bad}/{len(n.gpus)}" in row, row
    attention = re.search(r'<div class="attention" id="attention">(.*?)</div>', page, re.S)
    assert attention is not None
    assert text(attention.group(1)) == (
        "Needs a look: gpu-b02 lost · gpu-a01 1 unhealthy GPU · gpu-a03 draining · gpu-a02 cordoned"
    )
