"""What following the engines' KV events costs a router (issue 32): the firehose at GPU sizes.

A real nats-server and a real ``llmgw router`` process; this script plays the agents of ``--nodes`` nodes
(``--replicas`` each), publishing what they would relay for ``--rate`` requests a second across the
cluster, each storing the blocks of a ``--prompt``-token prompt in ``--block``-token blocks (``--reuse``:
the share of a prompt's blocks already cached, not published again; 0 is the worst case) and evicting as
many old ones. Batches go out per node every 50 ms, as the agents send them. The router's CPU is read
from /proc before and after a steady window, beside an idle window of the same length: what is printed
is the cost of following, in share of one core, and the bytes per request on the bus.

    .venv/bin/python bench/kv_firehose.py                     # 1,000 req/s, 2,000 tokens, 16-token blocks
    .venv/bin/python bench/kv_firehose.py --reuse 0.9         # a chat's later turns: 90 % already cached
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
import psutil
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.kit.ports import free_port

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import encode
from llmgw_common.kvcache import KvDeltas, KvSnapshot, ReplicaKv
from llmgw_common.messages import Endpoint, RoutingCatalog, RoutingEndpoints
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer

PREFIX = "fire"
BATCH_S = 0.05


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def start_router(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "llmgw_cli", "router", "--port", str(free_port()), "--router-id", "fire"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


async def main(a: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-firehose-"))
    srv = NatsServer(tmp / "nats", port=free_port())
    srv.start()
    nc = await nats.connect(srv.url)
    sub = Subjects(PREFIX)
    kv = await bus.ensure_kv(nc.jetstream(), sub.bucket_routing)
    await kv.put(
        "catalog",
        encode(RoutingCatalog(version=1, catalog=Catalog(models=(ModelProfile(name="m", engine="sim"),)))),
    )
    nodes = [f"n{i}" for i in range(a.nodes)]
    reps = {n: [f"{n}-r{j}" for j in range(a.replicas)] for n in nodes}
    eps = tuple(
        Endpoint(replica_id=r, model="m", url=f"http://127.0.0.1:9/{r}", node=n)
        for n in nodes
        for r in reps[n]
    )
    await kv.put("endpoints", encode(RoutingEndpoints(version=1, endpoints={"m": eps})))
    held: dict[str, list[int]] = {r: [] for n in nodes for r in reps[n]}
    seq = dict.fromkeys(nodes, 0)

    # The agents answer snapshots as real ones do (one page: every replica's keys, at the current seq).
    # Unanswered, the router would drop each node's entries at every retry of its snapshot and sweep them:
    # a cost of this script's agents, not of following the events.
    async def snapshot(msg: Msg) -> None:
        n = msg.subject.split(".")[-2]
        page = KvSnapshot(
            node=n,
            stream="boot-1",
            seq=seq[n],
            sent_at=time.time(),
            running=reps[n],
            replicas=[ReplicaKv(replica=r, model="m", block_size=a.block, stored=held[r]) for r in reps[n]],
        )
        await msg.respond(encode(page))

    for n in nodes:
        await nc.subscribe(sub.kv_snapshot(n), cb=snapshot)
    env = {**os.environ, "LLMGW_PREFIX": PREFIX, "LLMGW_NATS_URLS": srv.url}
    router = start_router(env, tmp / "router.log")
    try:
        await asyncio.sleep(3.0)  # started, followers running
        rng = random.Random(1)
        blocks = a.prompt // a.block
        new_per_req = max(1, round(blocks * (1 - a.reuse)))
        per_batch = a.rate * BATCH_S / len(nodes)  # requests per node per batch
        sent_bytes = 0
        sent_reqs = 0.0

        async def one_round() -> None:
            nonlocal sent_bytes, sent_reqs
            for n in nodes:
                k = int(per_batch) + (1 if rng.random() < per_batch - int(per_batch) else 0)
                changes: dict[str, tuple[list[int], list[int]]] = {}
                for _ in range(k):
                    r = rng.choice(reps[n])
                    stored = [rng.getrandbits(64) for _ in range(new_per_req)]
                    cache = held[r]
                    removed = cache[: len(stored)] if len(cache) > a.capacity else []
                    del cache[: len(removed)]
                    cache.extend(stored)
                    s, rm = changes.setdefault(r, ([], []))
                    s += stored
                    rm += removed
                sent_reqs += k
                if not changes:
                    continue
                seq[n] += 1
                msg = KvDeltas(
                    node=n,
                    stream="boot-1",
                    seq=seq[n],
                    sent_at=time.time(),
                    replicas=[
                        ReplicaKv(replica=r, model="m", block_size=a.block, stored=s, removed=rm)
                        for r, (s, rm) in changes.items()
                    ],
                )
                data = encode(msg)
                sent_bytes += len(data)
                await nc.publish(sub.kv(n), data)
            await nc.flush()

        async def window(seconds: float, publish: bool) -> float:
            c0, t0 = cpu_s(router.pid), time.monotonic()
            end = t0 + seconds
            while time.monotonic() < end:
                t = time.monotonic()
                if publish:
                    await one_round()
                await asyncio.sleep(max(0.0, BATCH_S - (time.monotonic() - t)))
            return (cpu_s(router.pid) - c0) / (time.monotonic() - t0)

        # The index filled to its steady size first (every replica at capacity), untimed.
        await window(a.warmup, True)
        idle = await window(a.seconds, False)
        sent_bytes, sent_reqs = 0, 0.0
        busy = await window(a.seconds, True)
        per_req = sent_bytes / max(sent_reqs, 1)
        print(f"command: {' '.join(sys.argv)}")
        print(
            f"{a.rate} req/s over {a.nodes} nodes x {a.replicas} replicas, {a.prompt}-token prompts in "
            f"{a.block}-token blocks, reuse {a.reuse:.0%}: {new_per_req} new keys a request"
        )
        print(f"router CPU idle      {idle * 100:6.2f} % of a core")
        print(
            f"router CPU following {busy * 100:6.2f} % of a core  (+{(busy - idle) * 100:.2f} % for the events)"
        )
        print(f"on the bus: {per_req:,.0f} bytes a request, {sent_bytes / a.seconds / 1e6:.2f} MB/s")
        # On a loaded machine this script may not keep pace: what it managed is what was measured.
        print(f"published {sent_reqs / a.seconds:,.0f} requests' worth a second (asked {a.rate:,.0f})")
    finally:
        router.terminate()
        router.wait(15)
        await nc.close()
        srv.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1000.0, help="requests a second across the cluster")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2, help="per node")
    p.add_argument("--prompt", type=int, default=2000, help="tokens")
    p.add_argument("--block", type=int, default=16, help="tokens a block")
    p.add_argument("--reuse", type=float, default=0.0, help="share of a prompt's blocks already cached")
    p.add_argument("--capacity", type=int, default=10_000, help="blocks a replica holds (then old ones go)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=5.0)
    asyncio.run(main(p.parse_args()))
