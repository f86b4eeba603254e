"""llmgw around real vLLM: the chaos tests' cluster (nats-server, control plane, router, as processes) with
agents that run real engines, the ``make vllm`` install as their ``vllm`` command.

Each agent is a node of its own on this machine; the cores its engines may use come from the agent's
environment (``VLLM_CPU_OMP_THREADS_BIND``, inherited by its engines), so two replicas of one profile
on two nodes get a core each instead of sharing one. Engines inherit the cluster's marker variable, so
:meth:`ChaosCluster.close` finds and kills any vLLM process (EngineCore, Worker included) left over.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import yaml
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import decode
from llmgw_common.messages import LoadReport, ReplicaLoad, RoutingEndpoints
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.settings import BusSettings
from tests.chaos.chaos_harness import ChaosCluster, Proc
from tests.chaos.chaos_waits import routing_table
from tests.vllm.vllm_kit import (
    BASE_ARGS,
    GEMMA,
    MINILM,
    ONE_WORKER_ARGS,
    ONE_WORKER_ENV,
    READY_TIMEOUT_S,
    VllmInstall,
)

# Heartbeats and ticks faster than the defaults (a killed replica is replaced sooner); a stop gives
# vLLM 10 s to shut down cleanly. A node is lost after the default 30 s of silence: a restarted agent
# takes 6-10 s to report again on a loaded box, and with the chaos tests' 4 s its engines were moved
# away (stopped) before it could re-adopt them.
SETTINGS: dict[str, str] = {
    "LLMGW_HEARTBEAT_INTERVAL_S": "0.5",
    "LLMGW_LEASE_TTL_S": "3",
    "LLMGW_SETTLE_S": "2",
    "LLMGW_TICK_S": "0.25",
    "LLMGW_STOP_GRACE_S": "10",
    "LLMGW_QUIESCE_S": "10",
    "LLMGW_BACKOFF_BASE_S": "2",
}


def profile(
    name: str,
    weights: str,
    *,
    replicas: int = 1,
    args: tuple[str, ...] = BASE_ARGS,
    options: dict[str, object] | None = None,
    **extra: object,
) -> dict[str, object]:
    """A vLLM-on-CPU catalog entry (``options.device: cpu``) for the install's models."""
    return {
        "name": name,
        "engine": "vllm",
        "replicas": replicas,
        "weights": weights,
        "startup_timeout_s": READY_TIMEOUT_S,
        "args": list(args),
        "options": {"device": "cpu", **(options or {})},
        "env": {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            # vLLM's response store: the fidelity modules compare stored responses on these engines.
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
            # The in-process Worker (vllm_kit.ONE_WORKER_ARGS) needs it; without those args vLLM would
            # still pick it on CPU with this set, so it comes only with them.
            **(ONE_WORKER_ENV if _has(args, ONE_WORKER_ARGS) else {}),
        },
        **extra,
    }


def _has(args: tuple[str, ...], part: tuple[str, ...]) -> bool:
    return any(args[i : i + len(part)] == part for i in range(len(args)))


def catalog_yaml(*models: dict[str, object]) -> str:
    return yaml.safe_dump({"models": list(models)}, sort_keys=False)


GEMMA_PAIR = profile("gemma", GEMMA, replicas=2)
NODES = ("node-a", "node-b")
# all-MiniLM-L6-v2 has 256 positions: vLLM refuses a longer --max-model-len. Its Worker is a process of
# its own, as vLLM runs by default: the stop test sees a whole three-process group go.
MINILM_ONE = profile(
    "minilm", MINILM, args=("--max-model-len", "256", "--enforce-eager", "--runner", "pooling")
)
CATALOG = catalog_yaml(GEMMA_PAIR, MINILM_ONE)


@dataclass
class VllmCluster(ChaosCluster):
    """A :class:`ChaosCluster` whose agents run real vLLM from ``install``."""

    install: VllmInstall | None = None
    # The catalog it serves: the one it started with, then the last one applied.
    applied: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.applied = self.applied or self.catalog

    def start_real_agent(self, node: str, cores: str) -> Proc:
        assert self.install is not None
        env = {
            "LLMGW_VLLM": self.install.command_line,
            "LLMGW_VLLM_CPU": "true",
            "VLLM_CPU_OMP_THREADS_BIND": cores,
        }
        argv = ["agent", "--node", node, "--real-engines", "--model-dir", str(self.install.root / "models")]
        argv += ["--state-dir", str(self.root / "agents" / node)]
        return self._proc(f"agent-{node}", argv, env)

    def vllm_pids(self) -> set[int]:
        """Every live vLLM process of this cluster: API servers, EngineCores, Workers."""
        out = set()
        for p in self.members():
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(p.cmdline())
                if "vllm" in cmd.lower() or "VLLM" in p.name():
                    out.add(p.pid)
        return out

    async def ctl(self, *args: str, ok: bool = True) -> str:
        """``llmgw ctl ARGS`` against this cluster; its stdout (asserted to succeed unless ``ok`` is False)."""
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmgw_cli", "ctl", *args, "--nats", self.nats_url, "--prefix", self.prefix,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env(),
        )  # fmt: skip
        out, err = await p.communicate()
        if ok:
            assert p.returncode == 0, f"ctl {' '.join(args)}: {err.decode()}"
        return out.decode() + err.decode()

    async def apply(self, catalog: str) -> str:
        path = self.root / "catalog-applied.yaml"
        path.write_text(catalog)
        said = await self.ctl("catalog", "apply", str(path))
        self.applied = catalog
        return said


async def endpoints(
    c: ChaosCluster, model: str, count: int, timeout: float = READY_TIMEOUT_S
) -> RoutingEndpoints:
    """The routing table once it lists exactly ``count`` endpoints for ``model`` (a vLLM start's time)."""
    return await routing_table(c, model, count, timeout, every=0.5)


@contextlib.asynccontextmanager
async def chat_stream(
    http: httpx.AsyncClient, c: ChaosCluster, key: str, body: dict[str, object]
) -> AsyncIterator[AsyncIterator[str]]:
    """A streamed chat completion through the cluster's router (asserted 200): its lines."""
    hdrs = {"Authorization": f"Bearer {key}"}
    async with http.stream("POST", f"{c.router_url()}/v1/chat/completions", json=body, headers=hdrs) as r:
        assert r.status_code == 200, await r.aread()
        yield r.aiter_lines()


def engine_log_tails(c: ChaosCluster, lines: int = 30) -> str:
    parts = []
    for f in sorted(Path(c.root / "agents").glob("*/logs/*.log")):
        parts.append(
            f"--- engine {f.parent.parent.name}/{f.name}:\n"
            + "\n".join(f.read_text(errors="replace").splitlines()[-lines:])
        )
    return "\n".join(parts)


class LoadWatch:
    """The latest load report of every replica on the cluster's nodes, as the agents publish them."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.latest: dict[str, ReplicaLoad] = {}
        self.reports = 0

    @classmethod
    async def connect(cls, c: ChaosCluster, nodes: tuple[str, ...]) -> LoadWatch:
        w = cls(await bus.connect(BusSettings(nats_urls=[c.nats_url], prefix=c.prefix), "vllm-loads"))
        for n in nodes:
            await w.nc.subscribe(Subjects(c.prefix).load(n), cb=w._on_load)
        return w

    async def _on_load(self, msg: Msg) -> None:
        rep = decode(msg.data, LoadReport)
        self.reports += 1
        for r in rep.replicas:
            self.latest[r.replica_id] = r

    def load(self, replica_id: str) -> ReplicaLoad | None:
        return self.latest.get(replica_id)

    async def close(self) -> None:
        await self.nc.close()
