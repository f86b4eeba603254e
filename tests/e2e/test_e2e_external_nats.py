"""`llmgw up --nats URL --no-local-agent`: joins an existing NATS under its own prefix and starts none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from llmgw_runtime.natsserver import NatsServer
from tests.e2e.e2e_cluster import chat_once, start_up, stop_up

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e")]


def test_existing_nats_is_used_and_left_running(nats_server: NatsServer, prefix: str, tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes: [{name: gpu-x, fabric: f1, gpus: 1xL4-24GB, memory_gb: 64}]\n")
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text("models: [{name: small, engine: sim, options: {startup_s: 0.2}}]\n")
    nats_pid = nats_server.pid
    assert nats_pid is not None
    c = start_up(
        tmp_path / "data",
        "--nats", nats_server.url, "--prefix", prefix, "--no-local-agent",
        "--fleet", str(fleet), "--catalog", str(catalog),
    )  # fmt: skip
    try:
        assert c.state["nats_url"] == nats_server.url and c.state["nats_pid"] is None
        assert not (tmp_path / "data" / "nats").exists()
        assert chat_once(c, "small").status_code == 200
        bus = ["--nats", nats_server.url, "--prefix", prefix]
        r = subprocess.run(
            [sys.executable, "-m", "llmgw_cli", "ctl", "nodes", "-o", "json", *bus],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, r.stderr
        assert [n["name"] for n in json.loads(r.stdout)["nodes"]] == ["gpu-x"]
        children = [p.pid for p in psutil.Process(c.proc.pid).children(recursive=True)]
    finally:
        assert stop_up(c) == 0, c.diagnostics()
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    # The NATS it did not start is still there.
    assert psutil.Process(nats_pid).is_running()
