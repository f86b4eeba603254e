"""The Rust peers of bench/kv_routing.py: ``vllm-router`` (``kv_aware``, ``cache_aware``) and ``smg``.

They are installed once into a venv of their own, outside the repository, and reused:

    python3 -m venv ~/.cache/llmgw/peers/venv && ~/.cache/llmgw/peers/venv/bin/pip install vllm-router==0.1.17 smg

(the bench runs that itself when the venv lacks them). Flags below are from their ``--help``
(vllm-router 0.1.17, smg 1.13).

``vllm-router --policy kv_aware`` subscribes to each engine's ZMQ KV-event publisher, but takes only
``tcp://HOST:PORT`` endpoints, and the engines publish on ``ipc://`` in their run directories (issue 32:
a tcp endpoint makes vLLM connect, not bind). So for each engine the bench runs a ZMQ forwarder (XSUB
connected to the engine's socket, XPUB bound on a loopback port): the peer then reads the very events
llmgw's agent reads.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
import zmq
import zmq.devices

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kit.ports import free_port
from tests.kit.promtext import samples

# Ports handed out to peers not yet listening: free_port() alone could give two of them the same one.
_TAKEN: set[int] = set()


def _port() -> int:
    while True:
        p = free_port()
        if p not in _TAKEN:
            _TAKEN.add(p)
            return p


PEERS_DIR = Path(os.environ.get("LLMGW_PEERS_DIR", Path.home() / ".cache" / "llmgw" / "peers"))
PEER_PACKAGES = ("vllm-router==0.1.17", "smg")


def peer_bin(name: str) -> Path:
    return PEERS_DIR / "venv" / "bin" / name


def ensure_peers(install: bool) -> str | None:
    """None when both peers' commands are there (installed now if ``install``), else why not."""
    if all(peer_bin(n).exists() for n in ("vllm-router", "smg")):
        return None
    if not install:
        return f"peers not installed in {PEERS_DIR}/venv (run without --no-install, or see bench/kv_peers.py)"
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    venv = PEERS_DIR / "venv"
    steps = [
        ["python3", "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", "-q", *PEER_PACKAGES],
    ]
    for argv in steps:
        print(f"peers: {shlex.join(argv)}", flush=True)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            return f"`{shlex.join(argv)}` failed: {(r.stderr or r.stdout).strip()[-400:]}"
    missing = [n for n in ("vllm-router", "smg") if not peer_bin(n).exists()]
    return f"installed, but no {', '.join(missing)} in {venv}/bin" if missing else None


# ---------------------------------------------------------------- KV events


_SIM_FLAG = re.compile(r"--kv-events?-endpoint[= ](\S+)")


def events_endpoint(engine_url: str, replica: dict[str, object]) -> str | None:
    """Where the engine behind ``engine_url`` publishes its KV events, or None (it does not, yet).

    The replica's record first (a field named for it, should the control plane report one), else the
    engine's own command line: vLLM's ``--kv-events-config`` JSON, or the simulator's endpoint flag.
    """
    for k, v in replica.items():
        if "kv_events" in k and isinstance(v, str) and "://" in v:
            return v
    port = engine_url.rsplit(":", 1)[-1].rstrip("/")
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        on_port = any(
            (a == "--port" and i + 1 < len(cmd) and cmd[i + 1] == port) or a == f"--port={port}"
            for i, a in enumerate(cmd)
        )
        if not on_port:
            continue
        if "--kv-events-config" in cmd:
            try:
                cfg = json.loads(cmd[cmd.index("--kv-events-config") + 1])
                return str(cfg["endpoint"]) if cfg.get("enable_kv_cache_events", True) else None
            except (ValueError, KeyError, IndexError):
                return None
        m = _SIM_FLAG.search(" ".join(cmd))
        if m:
            return m.group(1)
    return None


@dataclass
class Relays:
    """One forwarder per engine: its ipc:// events on a loopback tcp:// port."""

    devices: list[zmq.devices.ThreadProxy]

    @classmethod
    def start(cls, sources: dict[str, str]) -> tuple[Relays, dict[str, str]]:
        """``sources``: engine URL -> its endpoint. Returns the relays and engine URL -> tcp endpoint."""
        out: dict[str, str] = {}
        devices = []
        for url, ep in sources.items():
            if ep.startswith("tcp://"):
                out[url] = ep
                continue
            port = _port()
            d = zmq.devices.ThreadProxy(zmq.XSUB, zmq.XPUB)  # type: ignore[no-untyped-call]
            d.connect_in(ep)
            d.bind_out(f"tcp://127.0.0.1:{port}")
            d.daemon = True
            d.start()
            devices.append(d)
            out[url] = f"tcp://127.0.0.1:{port}"
        return cls(devices), out


# ---------------------------------------------------------------- the peers' processes


@dataclass(frozen=True, slots=True)
class PeerSpec:
    name: str
    argv: list[str]
    url: str
    metrics_url: str


def vllm_router(
    policy: str, engines: list[str], events: dict[str, str], block_size: int, tokenizer: str | None
) -> PeerSpec:
    port, prom = _port(), _port()
    argv = [str(peer_bin("vllm-router")), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-port", str(prom), "--policy", policy, "--worker-urls", *engines]
    argv += ["--log-level", "warning", "--health-check-interval-secs", "5"]
    if policy == "kv_aware":
        for e in engines:
            argv += ["--kv-event-source", f"{e}={events[e]}"]
        argv += ["--kv-event-block-size", str(block_size)]
        if tokenizer:
            argv += ["--kv-event-model", tokenizer]
    return PeerSpec(
        f"vllm-router {policy}", argv, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom}/metrics"
    )


def smg(engines: list[str]) -> PeerSpec:
    port, prom = _port(), _port()
    argv = [str(peer_bin("smg")), "launch", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
    argv += ["--policy", "cache_aware", "--worker-urls", *engines]
    argv += ["--log-level", "warn"]
    return PeerSpec("smg cache_aware", argv, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom}/metrics")


def start_peer(spec: PeerSpec, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        return subprocess.Popen(spec.argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


# vllm-router's own count of kv_aware's index lookups, by result (hit, miss): whether the events it was
# fed ever matched a request's blocks.
KV_LOOKUPS = "vllm_router_kv_placement_lookups_total"


async def kv_lookups(specs: list[PeerSpec]) -> dict[str, float]:
    """``KV_LOOKUPS`` by result, summed over ``specs``' instances ({} where none reports it)."""
    out: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        for spec in specs:
            try:
                async with s.get(spec.metrics_url) as r:
                    text = await r.text()
            except (aiohttp.ClientError, TimeoutError):
                continue
            for (name, labels), v in samples(text).items():
                if name == KV_LOOKUPS:
                    result = dict(labels).get("result", "?")
                    out[result] = out.get(result, 0.0) + v
    return out
