"""`llmgw ctl` and `llmgw controlplane` through typer's CliRunner, against a real control-plane process
and the real nats-server, with fake agents publishing real messages."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from typer.testing import CliRunner, Result

from llmgw_cli.main import app
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.kit.agents import FakeAgent
from tests.kit.poll import eventually_sync

CATALOG = """
models:
  - name: small
    engine: sim
    replicas: 1
    gpu_class: H100-80GB
  - name: huge
    engine: sim
    replicas: 1
    gpu_class: B200
"""

runner = CliRunner()


class CP:
    def __init__(self, url: str, prefix: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.prefix, self.proc, self.log = url, prefix, proc, log

    def args(self) -> list[str]:
        return ["--nats", self.url, "--prefix", self.prefix]


async def _publish_agents(url: str, prefix: str) -> None:
    nc = await nats.connect(url)
    try:
        a = FakeAgent(nc, prefix, "gpu-a1", unhealthy={7: "XID 79"})
        b = FakeAgent(nc, prefix, "cpu-1", gpus=0, memory_gb=None, fabric=None)
        for ag in (a, b):
            await ag.send_inventory()
            await ag.beat()
        await bus.flush(nc)
    finally:
        await nc.close()


def _ctl(cp: CP, *args: str) -> Result:
    return runner.invoke(app, ["ctl", *args, *cp.args()])


@pytest.fixture
def cp(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory, prefix: str) -> Iterator[CP]:
    """A control plane of the test's own (its own prefix, so its own buckets): tests that change the
    catalog or the marks cannot change what another test sees, whatever the order."""
    d = tmp_path_factory.mktemp("cpcli")
    cat = d / "catalog.yaml"
    cat.write_text(CATALOG)
    log = d / "cp.log"
    env = {
        **os.environ,
        "LLMGW_TICK_S": "0.1",
        "LLMGW_SETTLE_S": "0",
        "LLMGW_HEARTBEAT_INTERVAL_S": "60",
        "LLMGW_NODE_LOST_S": "600",
        "LLMGW_LEASE_TTL_S": "3",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmgw_cli",
                "controlplane",
                "--nats",
                nats_server.url,
                "--prefix",
                prefix,
                "--catalog",
                str(cat),
                "--admin-port",
                "0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    c = CP(nats_server.url, prefix, proc, log)
    try:

        def answers() -> bool:
            assert proc.poll() is None, log.read_text()
            return _ctl(c, "nodes").exit_code == 0

        try:
            eventually_sync(answers, timeout=20, every=0.1, what="`llmgw ctl nodes` to succeed")
            asyncio.run(_publish_agents(nats_server.url, prefix))
            eventually_sync(
                lambda: "small" in _ctl(c, "replicas").output,
                timeout=20,
                every=0.1,
                what="`llmgw ctl replicas` to list small",
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log.read_text()}") from None
        yield c
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_nodes_table_and_json(cp: CP) -> None:
    r = _ctl(cp, "nodes")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[:3] == ["NODE", "STATE", "FABRIC"]
    row = next(line for line in lines if line.startswith("cpu-1"))
    assert " - " in row  # MEM not reported: "-", never 0
    assert "gpu-a1: GPU 7: XID 79" in r.output
    r = _ctl(cp, "nodes", "-o", "json")
    assert r.exit_code == 0
    nodes = {n["name"]: n for n in json.loads(r.output)["nodes"]}
    assert nodes["cpu-1"]["memory_gb"] is None
    assert (
        nodes["gpu-a1"]["gpus_used"],
        nodes["gpu-a1"]["gpus_free"],
        nodes["gpu-a1"]["gpus_unhealthy"],
    ) == (1, 6, 1)


@pytest.mark.slow
def test_replicas_idle_unknown_is_dash_and_negative(cp: CP) -> None:
    r = _ctl(cp, "replicas")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if " small " in line)
    assert row.split()[2] == "starting" and row.rstrip().endswith("-")
    r = _ctl(cp, "replicas", "-o", "json")
    (rep,) = [x for x in json.loads(r.output)["replicas"] if x["model"] == "small"]
    assert rep["idle_s"] < 0 and rep["idle_kind"] == "unknown" and rep["idle"] == "-"
    assert rep["error"] is None and rep["failed_at"] is None and not rep["outdated"]
    assert json.loads(r.output)["failed"] == []
    r = _ctl(cp, "replicas", "--failed")
    assert r.exit_code == 0 and "no failed replica kept" in r.output, r.output


@pytest.mark.slow
def test_models_and_status_name_what_is_short(cp: CP) -> None:
    r = _ctl(cp, "models")
    assert r.exit_code == 0, r.output
    huge = next(line for line in r.output.splitlines() if line.startswith("huge"))
    assert "unplaceable" in huge and "B200" in huge
    r = _ctl(cp, "status")
    assert r.exit_code == 0, r.output
    assert "H100-80GB" in r.output and "unplaceable:" in r.output and "warning: no webhook" in r.output
    st = json.loads(_ctl(cp, "status", "-o", "json").output)
    assert st["capacity"][0]["unhealthy"] == 1


@pytest.mark.slow
def test_explain_placement(cp: CP) -> None:
    r = _ctl(cp, "explain-placement", "huge")
    assert r.exit_code == 0, r.output
    assert "gpu-a1" in r.output and "refused" in r.output
    r = _ctl(cp, "explain-placement", "nope")
    assert r.exit_code == 1 and "not in the catalog" in r.stderr


@pytest.mark.slow
def test_catalog_show_diff_apply(cp: CP, tmp_path: Path) -> None:
    r = _ctl(cp, "catalog", "show")
    assert r.exit_code == 0 and "name: small" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: x\n    engine: vllm\n  - name: x\n    engine: sim\n")
    r = _ctl(cp, "catalog", "apply", str(bad))
    assert r.exit_code == 1
    assert "needs a GPU" in r.stderr and "duplicate name" in r.stderr and "the current one stays" in r.stderr
    good = tmp_path / "good.yaml"
    good.write_text(CATALOG.replace("replicas: 1\n    gpu_class: B200", "replicas: 0\n    gpu_class: B200"))
    r = _ctl(cp, "catalog", "diff", str(good))
    assert r.exit_code == 0 and "~ huge" in r.output and "replicas: 1 -> 0" in r.output
    r = _ctl(cp, "catalog", "apply", str(good), "-o", "json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.output)["diff"]["changed"][0]["name"] == "huge"
    r = _ctl(cp, "catalog", "diff", str(good))
    assert r.output.strip() == "no change"
    r = _ctl(cp, "catalog", "apply", str(tmp_path / "missing.yaml"))
    assert r.exit_code == 1 and "cannot read" in r.stderr


@pytest.mark.slow
def test_cordon_uncordon_drain(cp: CP) -> None:
    r = _ctl(cp, "cordon", "cpu-1")
    assert r.exit_code == 0 and "cordoned" in r.output
    n = {x["name"]: x for x in json.loads(_ctl(cp, "nodes", "-o", "json").output)["nodes"]}
    assert n["cpu-1"]["cordoned"]
    r = _ctl(cp, "drain", "cpu-1", "--grace", "10m")
    assert r.exit_code == 0 and "draining" in r.output
    n = {x["name"]: x for x in json.loads(_ctl(cp, "nodes", "-o", "json").output)["nodes"]}
    assert n["cpu-1"]["draining"] and n["cpu-1"]["drain_deadline"] - time.time() > 500
    r = _ctl(cp, "uncordon", "cpu-1", "-o", "json")
    assert r.exit_code == 0 and json.loads(r.output)["marks"] == {"cordoned": [], "draining": {}}
    r = _ctl(cp, "drain", "cpu-1", "--grace", "soon")
    assert r.exit_code == 1 and "not a duration" in r.stderr
    r = _ctl(cp, "cordon", "ghost")
    assert r.exit_code == 1 and "no node named 'ghost'" in r.stderr


def test_no_control_plane_exit_1_clear_message(nats_server: NatsServer) -> None:
    for verb in (["nodes"], ["status", "-o", "json"]):
        r = runner.invoke(
            app, ["ctl", *verb, "--nats", nats_server.url, "--prefix", "nobodyhome", "--timeout", "0.5"]
        )
        assert r.exit_code == 1
        assert "no control plane answered on nobodyhome.ctl." in r.stderr
        assert r.stdout == ""


@pytest.mark.slow
def test_unreachable_nats_exit_1() -> None:
    r = runner.invoke(app, ["ctl", "nodes", "--nats", "nats://127.0.0.1:1", "--timeout", "0.5"])
    assert r.exit_code == 1 and "cannot reach NATS" in r.stderr


@pytest.mark.slow
def test_bad_output_format(cp: CP) -> None:
    r = _ctl(cp, "nodes", "-o", "yaml")
    assert r.exit_code == 1 and "unknown output" in r.stderr


@pytest.mark.slow
def test_controlplane_refuses_an_invalid_catalog_file(nats_server: NatsServer, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: x\n    engine: vllm\n  - name: y\n    engine: nope\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw_cli",
            "controlplane",
            "--nats",
            nats_server.url,
            "--prefix",
            f"bad{os.getpid()}",
            "--catalog",
            str(bad),
            "--admin-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "not started" in r.stderr and "needs a GPU" in r.stderr and "unknown engine 'nope'" in r.stderr
