"""A served `llmgw up` keeps itself whole: a SIGKILLed router and nats-server are announced and
restarted, the router serves again, the control plane answers again over the restarted server, and
Ctrl-C still leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from llmgw_cli.devcluster import run_processes
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient, CtlError
from llmgw_runtime.settings import BusSettings
from tests.e2e.e2e_cluster import Cluster, start_up, stop_up, wait_model
from tests.kit.poll import eventually, eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def wait_output(c: Cluster, *needles: str, timeout: float = 60.0) -> None:
    try:
        eventually_sync(
            lambda: all(n in c.output() for n in needles),
            timeout=timeout,
            every=0.2,
            what=f"all of {needles} in up's output",
        )
    except AssertionError as e:
        raise AssertionError(f"{e}\n{c.diagnostics()}") from None


def state(c: Cluster) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((c.data_dir / "up.json").read_text())
    return data


def controlplane_leads(c: Cluster, timeout: float = 60.0) -> None:
    s = BusSettings(nats_urls=[c.nats_url], prefix=c.prefix)
    last = ""

    async def leads() -> bool:
        nonlocal last
        try:
            nc = await bus.connect(s, "test-up-restart", wait=False)
        except Exception as e:  # the server may still be starting: keep asking until the deadline
            last = repr(e)
            return False
        try:
            st = await CtlClient(nc, c.prefix, timeout=1.0).debug_stats()
            last = repr(st)
            return st.leader
        except CtlError as e:
            last = repr(e)
            return False
        finally:
            await nc.close()

    try:
        asyncio.run(
            eventually(leads, timeout=timeout, every=0.3, what="the control plane to answer ctl as leader")
        )
    except AssertionError as e:
        raise AssertionError(f"{e}: {last}\n{c.diagnostics()}") from None


def test_up_restarts_a_killed_router_and_nats_server(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes: [{name: n1, memory_gb: 64}]\n")
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(
        "models: [{name: tiny, engine: sim, options: {startup_s: 0.2, ttft_ms: 5, tokens_per_s: 500}}]\n"
    )
    data = tmp_path / "data"
    c = start_up(data, "--fleet", str(fleet), "--catalog", str(catalog), "--no-local-agent")
    token = str(c.state["run_token"])
    try:
        router = next(ch for ch in c.state["children"] if ch["name"] == "router")
        os.kill(router["pid"], signal.SIGKILL)
        wait_output(
            c,
            "llmgw up: router exited with code -9 (SIGKILL) after ",
            "s; restarting it in 1s (restart 1)",
            "llmgw up: router restarted (pid ",
        )
        wait_model(c, "tiny")
        routers = [ch for ch in state(c)["children"] if ch["name"] == "router"]
        assert routers[0]["restarts"] == 1 and routers[0]["pid"] != router["pid"]

        nats_pid = int(c.state["nats_pid"])
        os.kill(nats_pid, signal.SIGKILL)
        wait_output(
            c,
            "llmgw up: nats-server exited with code -9 (SIGKILL) after ",
            "llmgw up: nats-server restarted (pid ",
        )
        assert state(c)["nats_restarts"] == 1 and state(c)["nats_pid"] != nats_pid
        controlplane_leads(c)  # reconnected to the restarted server, it answers ctl again
        wait_model(c, "tiny")
        assert "controlplane exited" not in c.output()  # it rode the outage out, no restart needed
    finally:
        code = stop_up(c)
    assert code == 0, c.diagnostics()
    assert "llmgw up: stopped" in c.output()
    assert run_processes(token, data) == []
