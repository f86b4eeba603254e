"""The shipped ``tiny-cpu`` profile (engine sim, llama.cpp metric style): the agent scrapes it with
the names it serves, so its load reports carry running and waiting."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from llmgw_agent.engines import LaunchSpec, launch_spec
from llmgw_agent.metrics import LLAMACPP_METRICS, extract_load, parse_prometheus
from llmgw_agent.settings import AgentSettings
from llmgw_common.catalog import load_catalog_file
from llmgw_common.messages import ShardAssignment
from tests.agent.agent_helpers import free_port
from tests.http_clients import async_client
from tests.kit.poll import eventually

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "catalog.yaml"


def test_sim_profile_in_llamacpp_style_gets_llamacpp_names() -> None:
    profile = load_catalog_file(str(EXAMPLE)).get("tiny-cpu")
    assert profile is not None and profile.options["metrics_style"] == "llamacpp"
    a = ShardAssignment(
        replica_id="r1", shard=0, model="tiny-cpu", engine="sim", port=20001, options=profile.options
    )
    spec = launch_spec(a, AgentSettings(node="n1"))
    assert isinstance(spec, LaunchSpec), spec
    assert spec.argv[spec.argv.index("--metrics-style") + 1] == "llamacpp"
    assert spec.metrics == LLAMACPP_METRICS


@pytest.mark.slow
async def test_real_sim_engine_in_llamacpp_style_scraped_by_the_agent_gives_load() -> None:
    profile = load_catalog_file(str(EXAMPLE)).get("tiny-cpu")
    assert profile is not None
    port = free_port()
    a = ShardAssignment(
        replica_id="r1",
        shard=0,
        model="tiny-cpu",
        engine="sim",
        port=port,
        # One slot, so that a second request waits.
        options={**profile.options, "slots": 1, "tokens_per_s": 50},
    )
    spec = launch_spec(a, AgentSettings(node="n1"))
    assert isinstance(spec, LaunchSpec)
    health_url, metrics_url = spec.health_url, spec.metrics_url
    assert health_url and metrics_url
    proc = await asyncio.create_subprocess_exec(
        *spec.argv,
        env={**os.environ, **spec.env},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with async_client(timeout=30) as http:

            async def healthy() -> bool:
                return (await http.get(health_url)).status_code == 200

            await eventually(
                healthy, timeout=30, what="the engine to answer healthy", tolerate=(httpx.HTTPError,)
            )
            body = {"model": "tiny-cpu", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
            reqs = [
                asyncio.create_task(http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body))
                for _ in range(2)
            ]

            async def loaded() -> tuple[float | None, float | None] | None:
                # The agent's own scrape: its parser and the names of the spec it launched with.
                r = await http.get(metrics_url)
                load = extract_load(parse_prometheus(r.text), spec.metrics)
                return (load.running, load.waiting) if (load.running, load.waiting) == (1, 1) else None

            assert await eventually(
                loaded,
                timeout=15,
                what="1 running and 1 waiting in the agent's scrape",
                tolerate=(httpx.HTTPError,),
            ) == (1, 1)
            for t in reqs:
                t.cancel()
            await asyncio.gather(*reqs, return_exceptions=True)
    finally:
        proc.terminate()
        await proc.wait()
