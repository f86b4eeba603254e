"""bench/kv_routing.py's clusters: ``llmgw up`` over simulated nodes, or real vLLM; and extra routers.

Each llmgw mode is a catalog or settings choice over one cluster: ``cache_routing`` is the model's
catalog switch (applied with ``llmgw ctl catalog apply``, which restarts nothing), today's text-hash
affinity the router setting ``prefix_affinity`` (a router group of its own). The routers are ordinary
``llmgw router`` processes on the cluster's bus, so the engines' events flow engine -> agent -> bus ->
routers as in production.
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

MODEL = "bench"
GPU = "H100-80GB"
GPUS_PER_NODE = 4
VLLM_MAX_MODEL_LEN = 4096


def sim_catalog(replicas: int, mode: str | None, sim: dict[str, Any]) -> str:
    # engine vllm on simulated nodes: the simulator with vLLM's metric names; options it does not know
    # yet (block_size, prefill_tokens_per_s before the prefix cache lands) are dropped by the agent.
    m: dict[str, Any] = {"name": MODEL, "engine": "vllm", "gpu_class": GPU, "gpus_per_node": 1}
    m.update(replicas=replicas, options=sim)
    if mode is not None:
        m["cache_routing"] = mode
    return yaml.safe_dump({"models": [m]}, sort_keys=False)


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
    mode: str | None = None
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

    def replicas(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The model's ready replicas, and the errors of those that failed lately."""
        reply = json.loads(self.ctl("replicas", "--model", MODEL, "-o", "json"))
        ready = [r for r in reply.get("replicas", []) if r.get("state") == "ready" and r.get("endpoint")]
        return ready, [str(r.get("error")) for r in reply.get("failed", [])]

    def wait_engines(self, count: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any]] = []
        failed: list[str] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired, ValueError):
                seen, failed = self.replicas()
                if len(seen) >= count:
                    return seen
            time.sleep(1.0)
        why = f"; {len(failed)} failed, the last: {failed[0][-600:]}" if failed else ""
        raise RuntimeError(f"{len(seen)} of {count} replicas of {MODEL} ready after {timeout:.0f} s{why}")

    def set_mode(self, mode: str | None, settle_s: float) -> None:
        """The model's ``cache_routing`` (None: the engine's default); routers follow the catalog."""
        if mode == self.mode:
            return
        doc = yaml.safe_load(self.catalog)
        for m in doc["models"]:
            m.pop("cache_routing", None)
            if mode is not None:
                m["cache_routing"] = mode
        text = yaml.safe_dump(doc, sort_keys=False)
        path = self.root / "catalog-applied.yaml"
        path.write_text(text)
        self.ctl("catalog", "apply", str(path))
        self.catalog, self.mode = text, mode
        time.sleep(settle_s)
        # The switch is the routers': were it a field of the replicas' spec, the apply would roll every
        # replica (new engines, empty caches, new URLs) and the cases after it would compare nothing.
        reply = json.loads(self.ctl("replicas", "--model", MODEL, "-o", "json"))
        if any(r.get("outdated") for r in reply.get("replicas", [])):
            raise RuntimeError(f"applying cache_routing {mode} rolls the replicas: it cannot switch per case")
        # Where routers report their mode (ctl models' cache, merged over them), wait until it is this.
        if mode is None:
            return
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            seen = self.reported_mode()
            if seen is None or seen == mode:
                return
            time.sleep(1.0)
        print(
            f"kv_routing: routers still report mode {self.reported_mode()} after applying {mode}", flush=True
        )

    def reported_mode(self) -> str | None:
        """The model's routing mode as the routers report it (``ctl models``), None where none does."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired, ValueError):
            for m in json.loads(self.ctl("models", "-o", "json")).get("models", []):
                if m.get("name") == MODEL and m.get("cache"):
                    return str(m["cache"].get("mode"))
        return None

    def close(self) -> None:
        for c in reversed(self.closers):
            c()
        for p in reversed(self.procs):
            stop_group(p, 60.0)


def start_up(root: Path, replicas: int, mode: str | None, sim: dict[str, Any], timeout: float) -> Cluster:
    """``llmgw up --fleet F --catalog C --data-dir D`` as a process; returns once it serves."""
    (root / "fleet.yaml").write_text(fleet(replicas))
    catalog = sim_catalog(replicas, mode, sim)
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
    c = Cluster(root, catalog=catalog, mode=mode, procs=[p])
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


def start_vllm(root: Path, mode: str | None, timeout: float) -> Cluster:
    """Two real vLLM replicas of Gemma 3 270M, one core each (the tests' cluster, tests/vllm)."""
    from tests.chaos.chaos_waits import mint_key
    from tests.vllm.vllm_cluster import SETTINGS, VllmCluster, catalog_yaml, profile
    from tests.vllm.vllm_kit import GEMMA, ONE_WORKER_ARGS, find_vllm

    install = find_vllm()
    if install is None:
        raise RuntimeError("no vLLM install (make vllm; see docs/vllm.md)")
    # The tests' arguments but a longer context: a conversation's later turns pass the tests' 512.
    args = (
        "--max-model-len",
        str(VLLM_MAX_MODEL_LEN),
        "--enforce-eager",
        "--enable-prefix-caching",
        *ONE_WORKER_ARGS,
    )
    entry = profile(MODEL, GEMMA, replicas=2, args=args)
    if mode is not None:
        entry["cache_routing"] = mode
    catalog = catalog_yaml(entry)
    vc = VllmCluster(root, prefix="kvb", settings=dict(SETTINGS), catalog=catalog, install=install)
    c = Cluster(root, prefix="kvb", catalog=catalog, mode=mode, closers=[vc.close])
    try:
        vc.start_nats()
        vc.start_controlplane()
        vc.start_real_agent("node-a", "0")
        vc.start_real_agent("node-b", "1")
        c.nats_url = vc.nats_url
        c.key = mint_key(vc)
        c.wait_engines(2, timeout)
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
    """The KV index size one router reports for the bench's model in its demand reports (every tick,
    ``ModelDemand.cache.index_blocks``): (router start, sent at, blocks) of the latest."""

    latest: tuple[float, float, int] | None = None

    def on_report(self, data: bytes) -> None:
        from llmgw_common.codec import decode
        from llmgw_common.router_messages import DemandReport

        r = decode(data, DemandReport)
        m = r.models.get(MODEL)
        if m is not None and m.cache is not None:
            self.latest = (r.since, r.sent_at, m.cache.index_blocks)


async def restart_to_full_index(c: Cluster, group: Routers, timeout: float) -> tuple[float | None, str]:
    """Restart router 0 of ``group``; seconds from its new process's start until the index it reports
    holds what the old one's last report held (99 %: the engines evict meanwhile)."""
    from nats.aio.msg import Msg

    from llmgw_common.subjects import Subjects
    from llmgw_runtime import bus
    from llmgw_runtime.settings import BusSettings

    nc = await bus.connect(BusSettings(nats_urls=[c.nats_url], prefix=c.prefix), "kv-bench", wait=False)
    watch = IndexWatch()

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
        while time.time() - start < timeout:
            now = watch.latest
            if now is not None and now[0] >= start and now[2] >= 0.99 * before:
                return now[1] - start, f"{now[2]:,} of {before:,} blocks"
            await asyncio.sleep(0.05)
        return None, f"index not full {timeout:.0f} s after the restart ({watch.latest})"
    finally:
        await nc.close()
