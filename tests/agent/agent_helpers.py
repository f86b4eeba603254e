"""Helpers of the agent tests: free ports, a tiny scripted engine, a recorder of supervisor changes,
and a watcher of what an agent publishes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_agent.engines import LaunchSpec
from llmgw_agent.metrics import VLLM_METRICS
from llmgw_agent.settings import AgentSettings
from llmgw_agent.supervisor import Shard
from llmgw_common.codec import DecodeError, decode
from llmgw_common.messages import (
    Heartbeat,
    Inventory,
    LoadReport,
    ShardAssignment,
    ShardState,
    ShardStatus,
)
from tests.kit.ports import free_port as free_port  # the agent tests take it from here

# A stand-in engine whose behaviour the test chooses: health answers, exit, output, a grandchild.
ENGINE_SCRIPT = textwrap.dedent(
    """
    import argparse, http.server, os, signal, subprocess, sys, threading, time
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--lines", type=int, default=0)
    p.add_argument("--exit-now", type=int, default=None)
    p.add_argument("--exit-after", type=float, default=None)
    p.add_argument("--exit-code", type=int, default=7)
    p.add_argument("--healthy-for", type=float, default=None)
    p.add_argument("--never-healthy", action="store_true")
    p.add_argument("--grandchild", default=None)
    a = p.parse_args()
    for i in range(a.lines):
        print(f"engine line {i}", flush=True)
    if a.exit_now is not None:
        print("fatal: cannot load model", flush=True)
        sys.exit(a.exit_now)
    if a.grandchild:
        code = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        g = subprocess.Popen([sys.executable, "-c", code])
        with open(a.grandchild, "w") as f:
            f.write(str(g.pid))
    t0 = time.monotonic()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = not a.never_healthy and (a.healthy_for is None or time.monotonic() - t0 < a.healthy_for)
            if self.path == "/metrics":
                body = b"vllm:num_requests_running 2\\nvllm:num_requests_waiting 1\\n"
                code = 200
            else:
                body, code = (b"ok", 200) if ok else (b"loading", 503)
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print("listening", flush=True)
    if a.exit_after is not None:
        time.sleep(a.exit_after)
        print("engine crashed", flush=True)
        os._exit(a.exit_code)
    signal.sigwait([signal.SIGTERM])
    """
)


def script_spec(script: Path, port: int, *flags: str) -> LaunchSpec:
    return LaunchSpec(
        argv=(sys.executable, str(script), "--port", str(port), *flags),
        env={"CUDA_VISIBLE_DEVICES": ""},
        health_url=f"http://127.0.0.1:{port}/health",
        metrics_url=f"http://127.0.0.1:{port}/metrics",
        metrics=VLLM_METRICS,
    )


def assignment(port: int, replica: str = "r1", shard: int = 0, **kw: Any) -> ShardAssignment:
    base: dict[str, Any] = dict(replica_id=replica, shard=shard, model="m", engine="sim", port=port)
    base.update(kw)
    return ShardAssignment(**base)


class Recorder:
    """Collects supervisor changes; ``wait`` returns when a shard reaches a state."""

    def __init__(self) -> None:
        self.events: list[tuple[tuple[str, int], ShardState, str | None]] = []
        self._changed = asyncio.Condition()

    async def __call__(self, sh: Shard) -> None:
        self.events.append((sh.key, sh.state, sh.error))
        async with self._changed:
            self._changed.notify_all()

    def states(self, key: tuple[str, int]) -> list[ShardState]:
        return [s for k, s, _ in self.events if k == key]

    async def wait(self, key: tuple[str, int], state: ShardState, timeout: float = 15.0) -> None:
        async def reached() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: state in self.states(key))

        await asyncio.wait_for(reached(), timeout)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Watching what an agent publishes on the bus (the end-to-end tests of the agent service).
KINDS: dict[str, type[Any]] = {
    "heartbeat": Heartbeat,
    "inventory": Inventory,
    "status": ShardStatus,
    "load": LoadReport,
}


@dataclass
class Seen:
    """Everything a node published, decoded, with a way to wait for a condition on it."""

    msgs: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in KINDS})
    bad: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_msg(self, msg: Msg) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        try:
            self.msgs[kind].append(decode(msg.data, KINDS[kind]))
        except (DecodeError, KeyError):
            self.bad.append(msg.subject)
        self.changed.set()

    def mark(self, kind: str) -> int:
        return len(self.msgs[kind])

    async def wait(
        self, kind: str, pred: Callable[[Any], bool], timeout: float = 20.0, since: int = 0
    ) -> Any:
        """The first message of ``kind`` from index ``since`` on that satisfies ``pred``."""

        async def find() -> Any:
            while True:
                for m in self.msgs[kind][since:]:
                    if pred(m):
                        return m
                self.changed.clear()
                await self.changed.wait()

        return await asyncio.wait_for(find(), timeout)


async def watch_node(nc: NATS, prefix: str, node: str) -> Seen:
    seen = Seen()
    await nc.subscribe(f"{prefix}.node.{node}.*", cb=seen.on_msg)
    return seen


def shard_of(hb: Heartbeat, replica: str) -> Any:
    return next((s for s in hb.shards if s.replica_id == replica), None)


def fake_collect(s: AgentSettings, boot_id: str, now: float) -> Inventory:
    return Inventory(node=s.node, boot_id=boot_id, sent_at=now)
