"""Helpers of the agent tests: free ports, a tiny scripted engine, a recorder of supervisor changes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil

from llmgw_agent.engines import LaunchSpec
from llmgw_agent.metrics import VLLM_METRICS
from llmgw_agent.supervisor import Shard
from llmgw_common.messages import ShardAssignment, ShardState

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
