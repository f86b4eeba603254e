"""Control-plane scale: simulated fleets against a real control-plane process over a real nats-server.

The fleet is a load generator, not calls into the control plane: it publishes real Inventory and
Heartbeat messages on the real subjects (every node every 2 s), reads its assignments from the
``<prefix>_assign`` key publishes, and reports the assigned shards ready in its next heartbeats.

Per fleet size it prints:
- place-all: seconds from the first inventory to every placeable replica assigned;
- steady pass: the control plane's reconcile pass time (its own ``debug.stats`` timings) while nothing
  changes, p50 / p95 / max;
- ingest: heartbeats/s received at the 2-second cadence, and the most it took in a burst;
- CPU of the control-plane process at 2-second heartbeats (psutil, % of one core) and its RSS.

    .venv/bin/python bench/controlplane_scale.py            # 100, 1,000, 5,000 nodes, 500 models
    .venv/bin/python bench/controlplane_scale.py --quick    # 100 and 1,000 nodes, shorter windows
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
import psutil
import yaml
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.ctl import DebugStatsReply
from llmgw_common.messages import Assignment, GpuInfo, Heartbeat, Inventory, ShardReport, ShardState
from llmgw_common.subjects import Subjects
from llmgw_runtime.ctl_client import CtlClient, CtlUnavailable
from llmgw_runtime.natsserver import NatsServer, ensure_on_path

HEARTBEAT_S = 2.0
GPUS = 8
FABRICS = 4


def catalog(models: int) -> dict[str, object]:
    """500 models: GPU profiles of 1, 2, 4 and 8 cards, 1 or 2 replicas, a few 2-node ones, a few CPU ones."""
    out = []
    sizes = (1, 2, 4, 8)
    for i in range(models):
        if i % 50 == 49:
            out.append(
                {
                    "name": f"m{i:03d}",
                    "engine": "sim",
                    "replicas": 1,
                    "gpu_class": "H100-80GB",
                    "gpus_per_node": 8,
                    "nodes": 2,
                }
            )
        elif i % 25 == 24:
            out.append({"name": f"m{i:03d}", "engine": "sim", "replicas": 2})
        else:
            out.append(
                {
                    "name": f"m{i:03d}",
                    "engine": "sim",
                    "replicas": 1 + i % 2,
                    "gpu_class": "H100-80GB",
                    "gpus_per_node": sizes[i % 4],
                }
            )
    return {"models": out}


@dataclass
class Fleet:
    nc: NATS
    subjects: Subjects
    n: int
    boot: str = "boot-1"
    seq: int = 0
    # node -> its assigned shards, reported ready
    shards: dict[str, tuple[ShardReport, ...]] = field(default_factory=dict)
    published: int = 0

    def node(self, i: int) -> str:
        return f"n{i:05d}"

    def inventory(self, i: int) -> bytes:
        name = self.node(i)
        return encode(
            Inventory(
                node=name,
                boot_id=self.boot,
                sent_at=time.time(),
                fabric=f"ib-{i % FABRICS}",
                memory_gb=1024.0,
                cpus=96,
                engines=("sim", "vllm", "llamacpp"),
                simulated=True,
                gpus=tuple(
                    GpuInfo(
                        index=g, uuid=f"GPU-{name}-{g}", name="H100", gpu_class="H100-80GB", memory_mb=81559
                    )
                    for g in range(GPUS)
                ),
            )
        )

    async def send_inventories(self) -> None:
        for i in range(self.n):
            await self.nc.publish(self.subjects.inventory(self.node(i)), self.inventory(i))
            if i % 500 == 499:
                await self.nc.flush()
        await self.nc.flush()

    async def on_assign(self, msg: Msg) -> None:
        try:
            a = decode(msg.data, Assignment)
        except DecodeError:
            return
        self.shards[a.node] = tuple(
            ShardReport(
                replica_id=s.replica_id, shard=s.shard, model=s.model, state=ShardState.READY, port=s.port
            )
            for s in a.shards
        )

    async def beat_forever(self, interval: float = HEARTBEAT_S, slices: int = 20) -> None:
        """Every node once per ``interval``, spread over ``slices`` sends so the rate is even."""
        per = max(1, -(-self.n // slices))
        while True:
            t0 = time.monotonic()
            self.seq += 1
            for k in range(0, self.n, per):
                for i in range(k, min(self.n, k + per)):
                    name = self.node(i)
                    hb = Heartbeat(
                        node=name,
                        boot_id=self.boot,
                        seq=self.seq,
                        sent_at=time.time(),
                        shards=self.shards.get(name, ()),
                    )
                    await self.nc.publish(self.subjects.heartbeat(name), encode(hb))
                    self.published += 1
                await self.nc.flush()
                target = t0 + interval * (k + per) / self.n
                await asyncio.sleep(max(0.0, target - time.monotonic()))

    async def burst(self, count: int) -> None:
        name = self.node(0)
        for j in range(count):
            hb = Heartbeat(
                node=name,
                boot_id=self.boot,
                seq=10**9 + j,
                sent_at=time.time(),
                shards=self.shards.get(name, ()),
            )
            await self.nc.publish(self.subjects.heartbeat(name), encode(hb))
            if j % 1000 == 999:
                await self.nc.flush()
        await self.nc.flush()


async def stats(c: CtlClient) -> DebugStatsReply:
    return await c.debug_stats()


def start_cp(url: str, prefix: str, nodes: int, models: int, workdir: Path) -> subprocess.Popen[bytes]:
    cat = workdir / f"catalog-{nodes}.yaml"
    cat.write_text(yaml.safe_dump(catalog(models)))
    env = {
        **os.environ,
        "LLMGW_TICK_S": "1",
        "LLMGW_SETTLE_S": "0",
        "LLMGW_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
        "LLMGW_NODE_LOST_S": "60",
        "LLMGW_LOG_LEVEL": "WARNING",
    }
    with open(workdir / f"cp-{nodes}.log", "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmgw_cli",
                "controlplane",
                "--nats",
                url,
                "--prefix",
                prefix,
                "--catalog",
                str(cat),
                "--admin-port",
                "0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


async def run_size(
    url: str,
    prefix: str,
    proc: subprocess.Popen[bytes],
    nodes: int,
    models: int,
    steady_s: float,
    workdir: Path,
) -> dict[str, object]:
    ps = psutil.Process(proc.pid)
    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    c = CtlClient(nc, prefix, timeout=10.0)
    fleet = Fleet(nc, Subjects(prefix), nodes)
    beat: asyncio.Task[None] | None = None
    try:
        while True:
            try:
                s0 = await c.debug_stats()
                if s0.leader:
                    break
            except CtlUnavailable:
                pass
            if proc.poll() is not None:
                raise RuntimeError(
                    f"control plane exited: {(workdir / f'cp-{nodes}.log').read_text()[-2000:]}"
                )
            await asyncio.sleep(0.1)
        await nc.subscribe(f"$KV.{prefix}_assign.>", cb=fleet.on_assign)
        t0 = time.monotonic()
        await fleet.send_inventories()
        beat = asyncio.create_task(fleet.beat_forever())
        # Place-all: until every replica is placed, or placement stops progressing (the rest unplaceable).
        last_placed, last_change = -1, time.monotonic()
        while True:
            s = await stats(c)
            if s.placed_replicas != last_placed:
                last_placed, last_change = s.placed_replicas, time.monotonic()
            if s.placed_replicas >= s.desired_replicas and s.nodes >= nodes:
                break
            if s.nodes >= nodes and s.unplaceable_models and time.monotonic() - last_change > 3.0:
                break
            if time.monotonic() - t0 > 90:
                break
            await asyncio.sleep(0.1)
        place_s = last_change - t0
        # Let the fleet report its shards ready, then measure a window where nothing changes.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            s = await stats(c)
            if s.ready_replicas >= s.placed_replicas:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(HEARTBEAT_S)
        a = await stats(c)
        cpu0, w0 = ps.cpu_times(), time.monotonic()
        await asyncio.sleep(steady_s)
        b = await stats(c)
        cpu1, w1 = ps.cpu_times(), time.monotonic()
        cpu = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (w1 - w0) * 100
        n_new = b.passes - a.passes
        window = list(b.recent_pass_ms[-n_new:]) if n_new > 0 else [b.last_pass_ms]
        ingest = (b.heartbeats - a.heartbeats) / (w1 - w0)
        rss = ps.memory_info().rss / 2**20
        # Burst: as fast as one publisher can push; how fast does the control plane take them in?
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        beat = None
        await asyncio.sleep(0.5)
        c0 = (await stats(c)).heartbeats
        tb = time.monotonic()
        burst_n = 20000 if nodes < 5000 else 30000
        await fleet.burst(burst_n)
        while (await stats(c)).heartbeats < c0 + burst_n and time.monotonic() - tb < 20:
            await asyncio.sleep(0.05)
        burst_rate = ((await stats(c)).heartbeats - c0) / (time.monotonic() - tb)
        return {
            "nodes": nodes,
            "models": models,
            "desired": b.desired_replicas,
            "placed": b.placed_replicas,
            "ready": b.ready_replicas,
            "unplaceable_models": b.unplaceable_models,
            "place_all_s": round(place_s, 2),
            "pass_p50_ms": round(statistics.median(window), 2),
            "pass_p95_ms": round(sorted(window)[int(len(window) * 0.95)] if window else 0.0, 2),
            "pass_max_ms": round(max(window), 2),
            "passes_in_window": n_new,
            "ingest_hb_s": round(ingest),
            "burst_hb_s": round(burst_rate),
            "cpu_pct": round(cpu, 1),
            "rss_mb": round(rss),
            "dropped": b.dropped,
        }
    finally:
        if beat is not None:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
        await nc.close()


def stop_cp(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 and 1,000 nodes, shorter windows")
    ap.add_argument("--nodes", type=int, nargs="*", help="Fleet sizes (default 100 1000 5000)")
    ap.add_argument("--models", type=int, default=500)
    ap.add_argument("--steady", type=float, default=None, help="Seconds of steady state measured per size")
    args = ap.parse_args()
    sizes = args.nodes or ([100, 1000] if args.quick else [100, 1000, 5000])
    steady = args.steady or (6.0 if args.quick else 10.0)
    ensure_on_path()
    results = []
    with tempfile.TemporaryDirectory(prefix="llmgw-cpscale-") as d:
        srv = NatsServer(Path(d) / "nats")
        srv.start()
        try:
            for n in sizes:
                prefix = f"scale{n}"
                proc = start_cp(srv.url, prefix, n, args.models, Path(d))
                try:
                    r = asyncio.run(run_size(srv.url, prefix, proc, n, args.models, steady, Path(d)))
                finally:
                    stop_cp(proc)
                results.append(r)
                print(f"  {n} nodes done: {r}", file=sys.stderr, flush=True)
        finally:
            srv.stop()
    cols = [
        "nodes",
        "models",
        "desired",
        "placed",
        "ready",
        "unplaceable_models",
        "place_all_s",
        "pass_p50_ms",
        "pass_p95_ms",
        "pass_max_ms",
        "ingest_hb_s",
        "burst_hb_s",
        "cpu_pct",
        "rss_mb",
        "dropped",
    ]
    widths = [max(len(c), *(len(str(r[c])) for r in results)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in results:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths, strict=True)))


if __name__ == "__main__":
    main()
