"""Ctrl-C on `llmgw up` leaves no process behind; a second run on the same data dir keeps key and catalog.

This test stops what it starts, so it runs its own `llmgw up` rather than the shared one: it holds
whichever worker runs it, without depending on test order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from llmgw_cli.devcluster import RUN_MARKER, run_processes
from tests.e2e.e2e_cluster import Cluster, chat_once, shown_on_failure, start_up, stop_up
from tests.kit.poll import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e")]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def in_groups(pgids: set[int]) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) in pgids and alive(p.pid):
                out.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


def stop_and_check_nothing_left(
    cluster: Cluster,
    *,
    whole_group: bool,
    orphans: tuple[int, ...] = (),
    swept: tuple[int, ...] | None = None,
) -> None:
    """Stop `up` and check that no process of the run is left; ``orphans``: engines whose agent was
    killed; ``swept``: those `up` itself must sweep (default: all the orphans)."""
    state = json.loads((cluster.data_dir / "up.json").read_text())
    up = psutil.Process(cluster.proc.pid)
    # The catalog's five replicas run as engines, children of the agents in their own groups.
    procs: list[psutil.Process] = []

    def all_engines() -> list[psutil.Process]:
        nonlocal procs
        procs = up.children(recursive=True) + [psutil.Process(o) for o in orphans]
        engines = [p for p in procs if "sim-engine" in " ".join(p.cmdline())]
        return engines if len(engines) >= 5 else []

    with shown_on_failure(lambda: f"processes: {[p.cmdline() for p in procs]}"):
        engines = eventually_sync(all_engines, timeout=60.0, every=0.5, what="the five engines to run")
    pgids = {c["pgid"] for c in state["children"]} | {os.getpgid(e.pid) for e in engines}
    assert all(os.getpgid(e.pid) == e.pid for e in engines)
    # Engines carry the run's marker, so the last-resort sweep finds one whose agent died first.
    assert all(e.environ().get(RUN_MARKER) == state["run_token"] for e in engines)

    t0 = time.monotonic()
    rc = stop_up(cluster, whole_group=whole_group)
    took = time.monotonic() - t0
    out = cluster.output()
    assert rc == 0, out[-3000:]
    assert "llmgw up: stopped" in out
    diag = cluster.diagnostics()
    assert [p.pid for p in procs if alive(p.pid)] == [], diag
    assert state["nats_pid"] and not alive(state["nats_pid"])
    assert in_groups(pgids) == [], diag
    assert run_processes(state["run_token"], cluster.data_dir) == [], diag
    assert not (cluster.data_dir / "up.json").exists()
    left = [line for line in out.splitlines() if "left behind:" in line]
    # Each service stopped what it owns: `up` swept only the engines of a killed agent.
    expected = orphans if swept is None else swept
    assert sorted(int(x.split("left behind: ")[1].split()[0]) for x in left) == sorted(expected), diag
    assert took < 30, f"stopping took {took:.1f} s\n{diag}"


def ctl_models(cluster: Cluster) -> dict[str, Any]:
    bus = ["--nats", cluster.nats_url, "--prefix", cluster.prefix]
    r = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "ctl", "models", "-o", "json", *bus],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return {m["name"]: m for m in json.loads(r.stdout)["models"]}


def test_sigint_leaves_nothing_and_a_second_run_keeps_key_and_catalog(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = start_up(data)
    try:
        stop_and_check_nothing_left(first, whole_group=True)  # Ctrl-C in a terminal
    finally:
        stop_up(first)
    first_models = {"llama-3.1-8b", "qwen2.5-coder-7b", "tiny-cpu", "llama-3.1-70b"}
    other = tmp_path / "catalog.yaml"
    other.write_text("models: [{name: only-this, engine: sim}]\n")
    again = start_up(data, "--catalog", str(other))
    try:
        assert again.key == first.key
        assert "minted" not in again.output()
        assert (
            f"the bus already holds a catalog (from an earlier run): {other} is not loaded" in again.output()
        )
        assert (data / "dev-key").read_text().strip() == first.key
        # The bus had a catalog: the file given this time is not loaded over it.
        assert set(ctl_models(again)) == first_models
        assert chat_once(again, "tiny-cpu").status_code == 200
        # Killing one simulated node's agent orphans its engine, as on a crash; `up` restarts the agent,
        # which re-adopts the engine (and stops it at the end: nothing is left for `up` to sweep).
        agent = next(c for c in again.state["children"] if c["name"] == "agent-gpu-b1")
        engines = [p.pid for p in psutil.Process(agent["pid"]).children(recursive=True)]
        assert engines
        agent_log = again.logs_dir / "agent-gpu-b1.log"
        adopted_before = agent_log.read_text(errors="replace").count("re-adopting")
        os.kill(agent["pid"], signal.SIGKILL)
        with shown_on_failure(again.diagnostics):
            eventually_sync(
                lambda: (
                    "agent-gpu-b1 exited with code -9" in again.output()
                    and "agent-gpu-b1 restarted (pid " in again.output()
                    and agent_log.read_text(errors="replace").count("re-adopting")
                    >= adopted_before + len(engines)
                ),
                timeout=60.0,
                every=0.3,
                what="up to restart the killed agent and the agent to re-adopt its engines",
            )
        assert all(alive(e) for e in engines)  # adopted, not restarted
        stop_and_check_nothing_left(again, whole_group=False, orphans=tuple(engines), swept=())  # kill -INT
    finally:
        stop_up(again)
