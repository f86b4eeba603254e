"""ctl answers at fleet scale: N synthetic nodes on a nats-server with the default max_payload (1 MiB).

The control plane runs as its own process; the fleet's inventories are real messages on the real
subjects (``synthetic_inventories``, the generator of the placement benches); then the real CLI asks.
Prints each verb's answer size and time, and what ``llmgw ctl nodes -o json`` returned.

    .venv/bin/python bench/ctl_large_replies.py            # 5,000 nodes
    .venv/bin/python bench/ctl_large_replies.py 20000
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

import nats

from llmgw_common.codec import encode
from llmgw_common.subjects import Subjects
from llmgw_runtime.ctl_client import CtlClient, CtlUnavailable
from llmgw_runtime.natsserver import NatsServer, ensure_on_path
from llmgw_sim.synthetic import synthetic_inventories

PREFIX = "bench"
CATALOG = "models:\n  - {name: m, engine: sim, gpu_class: H100-80GB, replicas: 750}\n"


async def cli(url: str, *args: str) -> tuple[int, bytes, bytes, float]:
    t = time.perf_counter()
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw_cli", "ctl", *args, "--nats", url, "--prefix", PREFIX,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await p.communicate()
    return p.returncode or 0, out, err, time.perf_counter() - t


async def ask(c: CtlClient, verb: str) -> Any:
    """``verb`` once a leader answers: a control plane that stepped down takes the lease back in a TTL."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return await getattr(c, verb)()
        except CtlUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def run(n: int, workdir: str) -> None:
    with NatsServer(workdir) as srv:
        cat = os.path.join(workdir, "catalog.yaml")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update(LLMGW_NODE_LOST_S="600", LLMGW_HEARTBEAT_INTERVAL_S="30", LLMGW_SETTLE_S="0")
        env.update(LLMGW_LOG_LEVEL="WARNING")
        cp = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmgw_cli", "controlplane", "--nats", srv.url, "--prefix", PREFIX,
            "--catalog", cat, "--admin-port", "0", env=env,
        )  # fmt: skip
        nc = await nats.connect(srv.url)
        try:
            print(f"{n} nodes, server max_payload {nc.max_payload} bytes")
            c = CtlClient(nc, PREFIX, timeout=30)
            await ask(c, "debug_stats")
            subj = Subjects(PREFIX)
            for i, inv in enumerate(synthetic_inventories(n)):
                await nc.publish(subj.inventory(inv.node), encode(inv))
                if i % 500 == 499:
                    await nc.flush()
            await nc.flush()
            while (s := await ask(c, "debug_stats")).nodes < n or s.placed_replicas < 750:
                await asyncio.sleep(0.3)
            for verb in ("nodes", "replicas", "status", "models"):
                t = time.perf_counter()
                reply = await ask(c, verb)
                took = time.perf_counter() - t
                print(f"  ctl {verb}: {len(encode(reply)) / 1e6:.2f} MB in {took * 1000:.0f} ms")
            rc, out, err, took = await cli(srv.url, "nodes", "-o", "json")
            got = len(json.loads(out)["nodes"]) if rc == 0 else err.decode()[-300:]
            print(f"  llmgw ctl nodes -o json (default --timeout): exit {rc}, {got} nodes, {took:.1f}s")
        finally:
            await nc.close()
            cp.terminate()
            await cp.wait()


def main() -> None:
    ensure_on_path()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "catalog.yaml"), "w") as f:
            f.write(CATALOG)
        asyncio.run(run(n, d))


if __name__ == "__main__":
    main()
