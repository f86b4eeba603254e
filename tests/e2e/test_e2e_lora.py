"""LoRA adapters through a whole cluster of real processes (issue 33): nats-server, control plane, router
and an agent whose simulated engine serves adapters as vLLM 0.32 does (loaded at run time, files
checked). A request for an adapter loaded nowhere is held while the control plane asks the replica to
load it; a third adapter on a replica holding two lets the least recently used go; an adapter whose
files are missing is refused with a 503 that says so and shows in `ctl replicas`; after the engine is
killed, the replacement replica serves the adapters again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw_common.ctl import AdapterInfo
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient
from llmgw_runtime.settings import BusSettings
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster, boot
from tests.kit.poll import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _adapter_dir(root: Path, name: str) -> Path:
    d = root / "adapters" / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (d / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return d


def _catalog(root: Path) -> str:
    dirs = {n: _adapter_dir(root, n) for n in ("sql", "chat", "poem")}
    return f"""\
models:
  - name: base
    engine: sim
    gpu_class: H100-80GB
    replicas: 1
    max_loras: 2
    # Following load (a target never reached): routers report each adapter's requests, which the
    # control plane's least-recently-used order reads.
    max_replicas: 2
    target: {{in_flight_per_replica: 1000}}
    startup_timeout_s: 30
    options: {{startup_s: 0.3, ttft_ms: 10, tokens_per_s: 300, lora_load_s: 0.3, lora_check_files: true}}
adapters:
  - {{name: sql, base: base, weights: {dirs["sql"]}}}
  - {{name: chat, base: base, weights: {dirs["chat"]}}}
  - {{name: poem, base: base, weights: {dirs["poem"]}}}
  - {{name: broken, base: base, weights: {root / "adapters" / "missing"}}}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChaosCluster, str]]:
    root = tmp_path_factory.mktemp("lora")
    settings = {**AGGRESSIVE, "LLMGW_ADAPTER_MIN_RESIDENCY_S": "0"}
    c, key = boot(root, nodes=("n1",), model="base", replicas=1, settings=settings, catalog=_catalog(root))
    try:
        yield c, key
    finally:
        c.close()


def _chat(c: ChaosCluster, key: str, model: str, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(
        f"{c.router_url()}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": model,
            "messages": [{"role": "user", "content": "The capital of France is"}],
            "max_tokens": 12,
        },
        timeout=timeout,
    )


def _adapters(c: ChaosCluster) -> dict[str, AdapterInfo]:
    async def read() -> dict[str, AdapterInfo]:
        nc = await bus.connect(BusSettings(nats_urls=[c.nats_url], prefix=c.prefix), "test-lora")
        try:
            models = await CtlClient(nc, c.prefix, timeout=10).models()
            return {a.name: a for a in models.adapters}
        finally:
            await nc.close()

    return asyncio.run(read())


def test_an_adapter_is_loaded_on_demand_and_answers_as_itself(cluster: tuple[ChaosCluster, str]) -> None:
    c, key = cluster
    before = _adapters(c)["sql"]
    base = _chat(c, key, "base")
    sql = _chat(c, key, "sql")  # loaded nowhere: held while the control plane has it loaded
    assert base.status_code == 200 and sql.status_code == 200, sql.text
    assert sql.json()["model"] == "sql"
    assert sql.json()["choices"][0]["message"]["content"] != base.json()["choices"][0]["message"]["content"]
    info = _adapters(c)["sql"]
    assert info.state == "loaded" and len(info.loaded_on) == 1
    assert info.loads == before.loads + (0 if before.state == "loaded" else 1)


def test_a_third_adapter_lets_the_least_recently_used_go(cluster: tuple[ChaosCluster, str]) -> None:
    c, key = cluster
    assert _chat(c, key, "sql").status_code == 200
    engines = c.engine_pids()
    assert _chat(c, key, "chat").status_code == 200
    before = _adapters(c)
    assert before["sql"].state == before["chat"].state == "loaded"
    # sql was used before chat: with max_loras 2 the replica holds two, and sql goes for poem (once it
    # has been unused for the control plane's recent_use_s).
    r = _chat(c, key, "poem")
    assert r.status_code == 200, r.text
    after = _adapters(c)
    assert after["poem"].state == "loaded"
    assert after["sql"].unloads == before["sql"].unloads + 1 and after["sql"].loaded_on == ()
    assert after["chat"].unloads == before["chat"].unloads and after["chat"].state == "loaded"
    # Loads and unloads changed the assignment, never the engine: the same process throughout.
    assert c.engine_pids() == engines and len(engines) == 1


def test_an_adapter_whose_files_are_missing_is_refused_saying_so(cluster: tuple[ChaosCluster, str]) -> None:
    c, key = cluster
    r = _chat(c, key, "broken")
    assert r.status_code == 503, r.text
    assert "broken" in r.text and "missing weights" in r.text
    info = _adapters(c)["broken"]
    assert info.state == "failed" and "missing weights" in (info.reason or "")


def test_after_the_engine_is_killed_the_replacement_serves_the_adapters(
    cluster: tuple[ChaosCluster, str],
) -> None:
    c, key = cluster
    assert _chat(c, key, "chat").status_code == 200
    (pid,) = c.engine_pids()
    os.kill(pid, signal.SIGKILL)

    async def served() -> bool | None:
        r = await asyncio.to_thread(_chat, c, key, "chat", 30.0)
        return r.status_code == 200 or None

    asyncio.run(eventually(served, timeout=90, every=1.0, what="chat served by the replacement"))
    assert c.engine_pids() and pid not in c.engine_pids()
    assert _adapters(c)["chat"].state == "loaded"
