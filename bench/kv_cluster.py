"""bench/kv_routing.py's clusters: ``llmgw up`` over simulated nodes, or real vLLM; and extra routers.

Each llmgw mode is a catalog or settings choice: ``cache_routing`` is a model's catalog switch, today's
text-hash affinity the router setting ``prefix_affinity`` (a router group of its own). The switch is
part of a replica's spec (the engines' flags follow it: KV events on or off), so applying another mode
rolls every replica: new engines, empty caches. So the catalog holds one twin model per mode wanted,
``bench-<mode>``, alike but for the switch, side by side on the same nodes, and the cases interleave
over them with no catalog change. The routers are ordinary ``llmgw router`` processes on the
cluster's bus: the engines' events flow engine -> agent -> bus -> routers as in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.kit.ports import free_port  # noqa: E402

GPU = "H100-80GB"
GPUS_PER_NODE = 4
VLLM_MAX_MODEL_LEN = 4096


def model_for(mode: str) -> str:
    """The twin model whose catalog ``cache_routing`` is ``mode``."""
    return f"bench-{mode}"


def sim_catalog(replicas: int, modes: list[str], sim: dict[str, Any]) -> str:
    # engine vllm on simulated nodes: the simulator with vLLM's metric names; options it does not know
    # yet (block_size, prefill_tokens_per_s before the prefix cache lands) are dropped by the agent.
    models = [
        {"name": model_for(m), "engine": "vllm", "gpu_class": GPU, "gpus_per_node": 1, "replicas": replicas,
         "cache_routing": m, "options": sim}
        for m in modes
    ]  # fmt: skip
    return yaml.safe_dump({"models": models}, sort_keys=False)


def fleet(replicas: int) -> str:
    n = -(-replicas // GPUS_PER_NODE)
    nodes = [{"name": f"sim-{i}", "gpus": f"{GPUS_PER_NODE}x{GPU}", "memory_gb": 512} for i in range(n)]
    return yaml.safe_dump({"nodes": nodes}, sort_keys=False)


def stop_group(p: subprocess.Popen[bytes], grace: float) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds of these processes and their children (a router with workers is several)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            for q in [p, *p.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = q.cpu_times()
                    total += t.user + t.system
    return total


@dataclass
class Cluster:
    """What the bench needs of a cluster: its bus, a key, its catalog switch, its engines."""

    root: Path
    nats_url: str = ""
    prefix: str = "llmgw"
    key: str = ""
    catalog: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    closers: list[Any] = field(default_factory=list)

    def ctl(self, *args: str, timeout: float = 30.0) -> str:
        argv = [
            sys.executable,
            "-m",
            "llmgw_cli",
            "ctl",
            *args,
            "--nats",
            self.nats_url,
            "--prefix",
            self.prefix,
        ]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"llmgw ctl {' '.join(args)}: {r.stderr.strip()[-400:]}")
        return r.stdout

    def replicas(self, model: str) -> tuple[list[dict[str, Any]], list[str]]:
        """The model's ready replicas, and the errors of those that failed lately."""
        reply = json.loads(self.ctl("replicas", "--model", model, "-o", "json"))
        ready = [r for r in reply.get("replicas", []) if r.get("state") == "ready" and r.get("endpoint")]
        return ready, [str(r.get("error")) for r in reply.get("failed", [])]

    def wait_engines(self, model: str, count: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any]] = []
        failed: list[str] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired, ValueError):
                seen, failed = self.replicas(model)
                if len(seen) >= count:
                    return seen
            time.sleep(1.0)
        why = f"; {len(failed)} failed, the last: {failed[0][-600:]}" if failed else ""
        raise RuntimeError(f"{len(seen)} of {count} replicas of {model} ready after {timeout:.0f} s{why}")

    def close(self) -> None:
        for c in reversed(self.closers):
            c()
        for p in reversed(self.procs):
            stop_group(p, 60.0)


def start_up(root: Path, replicas: int, modes: list[str], sim: dict[str, Any], timeout: float) -> Cluster:
    """``llmgw up --fleet F --catalog C --data-dir D`` as a process; returns once it serves."""
    (root / "fleet.yaml").write_text(fleet(replicas * len(modes)))
    catalog = sim_catalog(replicas, modes, sim)
    (root / "catalog.yaml").write_text(catalog)
    data = root / "up"
    argv = [
        sys.executable,
        "-m",
        "llmgw_cli",
        "up",
        "--data-dir",
        str(data),
        "--fleet",
        str(root / "fleet.yaml"),
    ]
    argv += ["--catalog", str(root / "catalog.yaml"), "--port", "0", "--admin-port", "0", "--nats-port", "-1"]
    argv += ["--no-local-agent", "--ready-timeout", str(int(timeout))]
    with (root / "up.log").open("wb") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    c = Cluster(root, catalog=catalog, procs=[p])
    deadline = time.monotonic() + timeout
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if p.poll() is not None:
            c.close()
            raise RuntimeError(f"llmgw up exited ({p.returncode}): {(root / 'up.log').read_text()[-1500:]}")
        with contextlib.suppress(FileNotFoundError, ValueError):
            state = json.loads((data / "up.json").read_text())
            if state.get("ready"):
                break
        time.sleep(0.5)
    else:
        c.close()
        raise RuntimeError(f"llmgw up not ready in {timeout:.0f} s: {(root / 'up.log').read_text()[-1500:]}")
    c.nats_url, c.prefix, c.key = str(state["nats_url"]), str(state["prefix"]), str(state["key"])
    return c


def start_vllm(root: Path, modes: list[str], timeout: float) -> Cluster:
    """Two real vLLM replicas of Gemma 3 270M per mode, one on each core (the tests' cluster, tests/vllm)."""
    from tests.chaos.chaos_waits import mint_key
    from tests.vllm.vllm_cluster import SETTINGS, VllmCluster, catalog_yaml, profile
    from tests.vllm.vllm_kit import GEMMA, find_vllm

    install = find_vllm()
    if install is None:
        raise RuntimeError("no vLLM install (make vllm; see docs/vllm.md)")
    # The tests' arguments but a longer context (a conversation's later turns pass the tests' 512), and
    # without their in-process Worker: with it the engine computes in the API server's own loop, whose
    # /health then goes unanswered through a long prefill, and the agent stopped such engines mid-run
    # (3 failed checks in a row; seen in a smoke with two engines on a core).
    args = ("--max-model-len", str(VLLM_MAX_MODEL_LEN), "--enforce-eager", "--enable-prefix-caching")
    entries = [profile(model_for(m), GEMMA, replicas=2, args=args) for m in modes]
    for e, m in zip(entries, modes, strict=True):
        e["cache_routing"] = m
    catalog = catalog_yaml(*entries)
    vc = VllmCluster(root, prefix="kvb", settings=dict(SETTINGS), catalog=catalog, install=install)
    c = Cluster(root, prefix="kvb", catalog=catalog, closers=[vc.close])
    try:
        vc.start_nats()
        vc.start_controlplane()
        vc.start_real_agent("node-a", "0")
        vc.start_real_agent("node-b", "1")
        c.nats_url = vc.nats_url
        c.key = mint_key(vc)
        for m in modes:
            c.wait_engines(model_for(m), 2, timeout)
    except BaseException:
        c.close()
        raise
    return c


@dataclass
class Routers:
    """``count`` router processes on the cluster's bus, each on its own port (the client spreads
    requests over them, as a load balancer in front of several routers would)."""

    name: str
    cluster: Cluster
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: list[tuple[int, int]] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p, _ in self.ports]

    def router_id(self, i: int) -> str:
        return f"{self.name}-{i}"

    def start_one(self, i: int, extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        port, admin = self.ports[i]
        c = self.cluster
        argv = [sys.executable, "-m", "llmgw_cli", "router", "--nats", c.nats_url, "--prefix", c.prefix]
        argv += ["--port", str(port), "--admin-port", str(admin), "--router-id", self.router_id(i)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update(LLMGW_LOG_LEVEL="WARNING", **self.env, **(extra or {}))
        with (c.root / f"router-{self.name}-{i}.log").open("ab") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def start(self, count: int) -> Routers:
        for i in range(count):
            self.ports.append((free_port(), free_port()))
            self.procs.append(self.start_one(i))
        self.cluster.closers.append(self.stop)
        return self

    def restart(self, i: int, extra: dict[str, str] | None = None) -> float:
        """Stop router ``i`` and start it again; the wall-clock time of its new process's start."""
        stop_group(self.procs[i], 15.0)
        t = time.time()
        self.procs[i] = self.start_one(i, extra)
        return t

    def stop(self) -> None:
        for p in self.procs:
            stop_group(p, 15.0)


@dataclass
class IndexWatch:
    """The KV index size one router reports for ``model`` in its demand reports (every tick,
    ``ModelDemand.cache.index_blocks``): (router start, sent at, blocks) of the latest."""

    model: str
    latest: tuple[float, float, int] | None = None

    def on_report(self, data: bytes) -> None:
        from llmgw_common.codec import decode
        from llmgw_common.router_messages import DemandReport

        r = decode(data, DemandReport)
        m = r.models.get(self.model)
        if m is not None and m.cache is not None:
            self.latest = (r.since, r.sent_at, m.cache.index_blocks)


async def restart_to_full_index(
    c: Cluster, group: Routers, model: str, timeout: float
) -> tuple[float | None, str]:
    """Restart router 0 of ``group``; seconds from its new process's start until the index it reports
    holds what the old one's last report held (99 %: the engines evict meanwhile)."""
    from nats.aio.msg import Msg

    from llmgw_common.subjects import Subjects
    from llmgw_runtime import bus
    from llmgw_runtime.settings import BusSettings

    nc = await bus.connect(BusSettings(nats_urls=[c.nats_url], prefix=c.prefix), "kv-bench", wait=False)
    watch = IndexWatch(model)

    async def cb(msg: Msg) -> None:
        watch.on_report(msg.data)

    try:
        await nc.subscribe(Subjects(c.prefix).demand(group.router_id(0)), cb=cb)
        t0 = time.monotonic()
        while watch.latest is None and time.monotonic() - t0 < 5.0:
            await asyncio.sleep(0.1)
        if watch.latest is None:
            return None, "TODO: the router reports no KV index (ModelDemand.cache) yet"
        before = watch.latest[2]
        if before <= 0:
            return None, "the index was empty before the restart"
        # A faster tick for the restarted router only: its reports then tell the moment within 0.25 s.
        start = group.restart(0, {"LLMGW_TICK_S": "0.25"})
        first: float | None = None  # the new process's first report (its start, Python's imports included)
        while time.time() - start < timeout:
            now = watch.latest
            if now is not None and now[0] >= start:
                first = now[1] - start if first is None else first
                if now[2] >= 0.99 * before:
                    return now[
                        1
                    ] - start, f"{now[2]:,} of {before:,} blocks; its first report at {first:.2f} s"
            await asyncio.sleep(0.05)
        return None, f"index not full {timeout:.0f} s after the restart ({watch.latest})"
    finally:
        await nc.close()
