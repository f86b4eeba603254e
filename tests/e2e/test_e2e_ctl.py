"""`llmgw ctl` against a real `llmgw up`: the example fleet and catalog as the control plane sees them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.e2e_cluster import Cluster, shown_on_failure
from tests.kit.poll import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e")]


def ctl(cluster: Cluster, *args: str) -> Any:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw_cli",
            "ctl",
            *args,
            "--nats",
            cluster.nats_url,
            "--prefix",
            cluster.prefix,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout) if "-o" in args else r.stdout


def wait_ctl(cluster: Cluster, verb: str, ok: Callable[[Any], bool], timeout: float = 60.0) -> Any:
    """``ctl <verb> -o json`` until its reply satisfies ``ok``; returns that reply."""
    last: Any = None

    def satisfied() -> Any:
        nonlocal last
        last = ctl(cluster, verb, "-o", "json")
        return last if ok(last) else None

    with shown_on_failure(lambda: f"last reply: {json.dumps(last, indent=1)}"):
        return eventually_sync(satisfied, timeout=timeout, every=0.5, what=f"ctl {verb} to satisfy the test")


def test_nodes_show_the_fleet_and_the_local_machine(cluster: Cluster) -> None:
    reply = wait_ctl(
        cluster, "nodes", lambda r: len(r["nodes"]) == 4 and all(n["state"] == "ready" for n in r["nodes"])
    )
    nodes = {n["name"]: n for n in reply["nodes"]}
    assert set(nodes) == {"local", "gpu-a1", "gpu-a2", "gpu-b1"}
    assert (nodes["gpu-a1"]["fabric"], nodes["gpu-a1"]["gpu_summary"]) == ("ib-a", "8xH100-80GB")
    assert (nodes["gpu-b1"]["fabric"], nodes["gpu-b1"]["gpu_summary"]) == ("ib-b", "4xA100-80GB")
    assert nodes["gpu-b1"]["labels"] == {"role": "coding"}
    assert nodes["gpu-b1"]["memory_gb"] == 1024
    # The unhealthy GPU is neither used nor free.
    a2 = nodes["gpu-a2"]
    assert a2["gpus_unhealthy"] == 1
    assert any("XID 79 seen" in r for r in a2["unhealthy_reasons"])
    assert a2["gpus_used"] + a2["gpus_free"] == 7
    # The real machine: real memory, no GPUs.
    local = nodes["local"]
    assert local["gpus_total"] == 0 and local["memory_gb"] and local["memory_gb"] > 0
    table = ctl(cluster, "nodes")
    assert "gpu-a2" in table and "XID 79 seen" in table


def test_replicas_land_where_the_catalog_says(cluster: Cluster) -> None:
    reply = wait_ctl(
        cluster,
        "replicas",
        lambda r: sum(1 for x in r["replicas"] if x["state"] == "ready") >= 5,
    )
    by_model: dict[str, list[dict[str, Any]]] = {}
    for rep in reply["replicas"]:
        by_model.setdefault(rep["model"], []).append(rep)
    assert len(by_model["llama-3.1-8b"]) == 2
    assert {s["node"] for r in by_model["llama-3.1-8b"] for s in r["shards"]} <= {"gpu-a1", "gpu-a2"}
    (coder,) = by_model["qwen2.5-coder-7b"]
    assert [s["node"] for s in coder["shards"]] == ["gpu-b1"]
    # The unhealthy GPU 3 of gpu-a2 is never given to a replica.
    assert all(3 not in s["gpus"] for r in reply["replicas"] for s in r["shards"] if s["node"] == "gpu-a2")
    assert all(r["endpoint"] for r in reply["replicas"] if r["state"] == "ready")


def test_models_are_all_served(cluster: Cluster) -> None:
    reply = wait_ctl(cluster, "models", lambda r: all(m["state"] == "ok" for m in r["models"]))
    models = {m["name"]: m for m in reply["models"]}
    assert set(models) == {"llama-3.1-8b", "qwen2.5-coder-7b", "tiny-cpu", "llama-3.1-70b"}
    assert models["llama-3.1-8b"]["ready"] == 2
    assert models["llama-3.1-70b"]["watched"] is True
