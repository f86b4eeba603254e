"""The agent converging LoRA adapters on real simulated engines, with a real nats-server (issue 33):
loaded as the assignment asks and reported, changed without a restart, loaded again on a new engine,
busy while a request runs, and load failures reported per adapter in the user's terms."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS

from llmgw_agent.service import serve
from llmgw_agent.settings import AgentSettings
from llmgw_common.codec import encode
from llmgw_common.messages import AdapterLoad, Assignment, LoadReport, ReplicaLoad, ShardAssignment
from llmgw_common.subjects import Subjects
from llmgw_runtime.bus import ensure_kv
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import Seen, fake_collect, free_port, shard_of, watch_node

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPLICA = "gemma-1"


def line(report: LoadReport) -> ReplicaLoad | None:
    return next((r for r in report.replicas if r.replica_id == REPLICA), None)


def adapters_are(*names: str) -> Any:
    def check(m: LoadReport) -> bool:
        r = line(m)
        return r is not None and set(r.adapters) == set(names)

    return check


def shard(port: int, adapters: tuple[AdapterLoad, ...], **options: Any) -> ShardAssignment:
    return ShardAssignment(
        replica_id=REPLICA,
        shard=0,
        model="gemma",
        engine="sim",
        port=port,
        options={"tokens_per_s": 20, "ttft_ms": 0, **options},
        max_loras=2,
        max_lora_rank=8,
        adapters=adapters,
    )


class Cluster:
    """One agent on a real nats-server, and the assignment bucket it follows."""

    def __init__(self, s: AgentSettings, seen: Seen, kv: Any) -> None:
        self.s, self.seen, self.kv = s, seen, kv
        self.fence = 0

    async def assign(self, *shards: ShardAssignment) -> None:
        self.fence += 1
        await self.kv.put(self.s.node, encode(Assignment(node=self.s.node, fence=self.fence, shards=shards)))

    async def pid(self) -> int:
        """The engine's PID in the latest heartbeat that says it is ready."""
        since = max(0, self.seen.mark("heartbeat") - 1)
        hb = await self.seen.wait(
            "heartbeat", lambda h: (x := shard_of(h, REPLICA)) is not None and x.state == "ready", since=since
        )
        pid = shard_of(hb, REPLICA).pid
        assert isinstance(pid, int)
        return pid

    async def report(self, pred: Any, timeout: float = 30.0, *, newer: bool = False) -> ReplicaLoad:
        """A load report of the replica satisfying ``pred``: the latest one on, or (``newer``) only one
        sent after this call (not an earlier engine's)."""
        mark = self.seen.mark("load")
        m = await self.seen.wait("load", pred, timeout=timeout, since=mark if newer else max(0, mark - 1))
        r = line(m)
        assert r is not None
        return r


async def run_agent(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path, node: str
) -> tuple[Cluster, asyncio.Event, asyncio.Task[None]]:
    s = AgentSettings(
        node=node,
        nats_urls=[nats_server.url],
        prefix=prefix,
        state_dir=str(tmp_path / "agent"),
        model_dirs=[str(tmp_path / "models")],
        heartbeat_interval_s=0.3,
        load_interval_s=0.2,
        stop_grace_s=2.0,
    )
    (tmp_path / "models").mkdir(exist_ok=True)
    seen = await watch_node(nc, prefix, node)
    kv = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_assign)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(s, stop, collect=fake_collect))
    return Cluster(s, seen, kv), stop, task


async def test_adapters_follow_the_assignment_without_a_restart_and_again_on_a_new_engine(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    c, stop, agent = await run_agent(nats_server, nc, prefix, tmp_path, "lora1")
    port = free_port()
    a, b, x = (AdapterLoad(name=n, weights=f"/adapters/{n}") for n in ("fr", "de", "it"))
    try:
        await c.assign(shard(port, (a, b)))
        pid = await c.pid()
        await c.report(adapters_are("fr", "de"))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            cards = (await http.get("/v1/models")).json()["data"]
            assert {(c["id"], c["parent"], c["root"]) for c in cards[1:]} == {
                ("fr", "gemma", "/adapters/fr"),
                ("de", "gemma", "/adapters/de"),
            }
            # Busy while a request for it runs (20 tokens/s: one second).
            slow = asyncio.create_task(
                http.post("/v1/completions", json={"model": "fr", "prompt": "x", "max_tokens": 20})
            )
            busy = await c.report(
                lambda m: (r := line(m)) is not None and "fr" in r.adapters_busy, timeout=10
            )
            assert busy.adapters_busy == ("fr",)
            assert (await slow).status_code == 200
            await c.report(lambda m: (r := line(m)) is not None and r.adapters_busy == ())

        # Adapters only: the same engine unloads one and loads another.
        await c.assign(shard(port, (b, x)))
        await c.report(adapters_are("de", "it"))
        assert await c.pid() == pid

        # A new engine (another port restarts it) gets the adapters again.
        port2 = free_port()
        await c.assign(shard(port2, (b, x)))
        await c.seen.wait(
            "heartbeat",
            lambda h: (s := shard_of(h, REPLICA)) is not None and s.port == port2 and s.state == "ready",
        )
        again = await c.report(
            lambda m: adapters_are("de", "it")(m) and (r := line(m)) is not None and not r.adapter_errors,
            newer=True,
        )
        assert again.adapters
        async with httpx.AsyncClient(timeout=10) as http:
            names = [c["id"] for c in (await http.get(f"http://127.0.0.1:{port2}/v1/models")).json()["data"]]
        assert sorted(names) == ["de", "gemma", "it"]
    finally:
        stop.set()
        await asyncio.wait_for(agent, 30)


async def test_load_failures_are_reported_per_adapter_in_the_users_terms(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    c, stop, agent = await run_agent(nats_server, nc, prefix, tmp_path, "lora2")
    models = tmp_path / "models"
    good = models / "fr-lora"
    good.mkdir(parents=True)
    (good / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (good / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    wide = models / "wide-lora"
    wide.mkdir()
    (wide / "adapter_config.json").write_text(json.dumps({"r": 16, "peft_type": "LORA"}))
    (wide / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    adapters = (
        AdapterLoad(name="fr", weights="fr-lora"),  # found under the model directories
        AdapterLoad(name="gone", weights="no-such-lora"),  # the simulator reads files: vLLM's 404
        AdapterLoad(name="wide", weights="wide-lora"),  # rank 16 in its files, the base allows 8
        AdapterLoad(name="big", weights="fr-lora", rank=64),  # the catalog says 64: never sent
    )
    port = free_port()
    try:
        await c.assign(shard(port, adapters, lora_check_files=True))
        r = await c.report(lambda m: (x := line(m)) is not None and len(x.adapter_errors) == 3)
        assert r.adapters == ("fr",)
        assert r.adapter_errors["gone"].startswith("missing weights: no LoRA adapter at no-such-lora")
        assert r.adapter_errors["wide"].startswith(
            "rank too large: the adapter's rank is 16, the base allows at most 8"
        )
        assert r.adapter_errors["big"].startswith("rank too large: the adapter's rank is 64")
        # Taken out of the assignment, its error goes too.
        await c.assign(shard(port, adapters[:1], lora_check_files=True))
        await c.report(
            lambda m: (x := line(m)) is not None and x.adapters == ("fr",) and not x.adapter_errors
        )
    finally:
        stop.set()
        await asyncio.wait_for(agent, 30)
