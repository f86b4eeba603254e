"""A real vLLM's spans under the router's, in one trace (issue 34): vLLM 0.32 started with the flags and
environment the agent's adapter gives it when an OTLP endpoint is set (``vllm_tracing``), a router
tracing to the same Arize Phoenix (``make otel-deps``); vLLM reads the router's ``traceparent`` and its
``llm_request`` span hangs under the router's attempt. A vLLM of its own (one start, ~1 min of CPU)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from llmgw_agent.engines import vllm_tracing
from llmgw_agent.settings import AgentSettings
from llmgw_router.service import Router
from llmgw_router.settings import RouterSettings
from tests.kit.phoenix import Phoenix, phoenix  # noqa: F401 (the fixture)
from tests.kit.poll import eventually
from tests.vllm.vllm_kit import VllmServer, engine_env, require_vllm, start_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1200)]
pytest.importorskip("opentelemetry.sdk.trace")

MODEL = "gemma-traced"


@pytest.fixture(scope="module")
def traced_vllm(phoenix: Phoenix, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:  # noqa: F811
    install = require_vllm()
    args, env = vllm_tracing((), AgentSettings(node="n1", otlp_traces_endpoint=phoenix.traces_endpoint))
    assert args, "the adapter gave vLLM no OTLP endpoint"
    server = start_vllm(
        install,
        install.gemma,
        tmp_path_factory.mktemp("vllm-tracing"),
        name=MODEL,
        args=args,
        env={**engine_env("0"), **env},
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


async def test_vllm_spans_hang_under_the_routers_attempt(
    traced_vllm: VllmServer,
    phoenix: Phoenix,  # noqa: F811
    tmp_path: Path,
) -> None:
    static = tmp_path / "static.yaml"
    static.write_text(
        yaml.safe_dump({"auth": False, "models": [{"name": MODEL, "endpoints": [traced_vllm.url]}]})
    )
    settings = RouterSettings(
        port=0, static_file=str(static), router_id="rvllm", otlp_traces_endpoint=phoenix.traces_endpoint
    )
    r = Router(settings)
    await r.start()
    try:
        await _check(r, traced_vllm, phoenix)
    finally:
        await r.stop()


async def _check(r: Router, traced_vllm: VllmServer, phoenix: Phoenix) -> None:  # noqa: F811
    assert r.ctx.tracing is not None
    trace_id, client_span = random.getrandbits(128) | 1, random.getrandbits(64) | 1
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
    headers = {"traceparent": f"00-{trace_id:032x}-{client_span:016x}-01"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        async with s.post(
            f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body, headers=headers
        ) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
    await asyncio.to_thread(r.ctx.tracing.tracer.provider.force_flush)

    async def complete() -> list[dict[str, Any]] | None:
        spans = await asyncio.to_thread(phoenix.spans, trace_id)
        names = {s["name"] for s in spans}
        return spans if {"llm_request", f"chat {MODEL}", "POST /v1/chat/completions"} <= names else None

    # vLLM exports in batches from its own thread (every 5 s by the SDK's default).
    spans = await eventually(complete, timeout=60.0, every=1.0, what="vLLM's span in the router's trace")
    (server,) = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    (attempt,) = [s for s in spans if s["name"] == f"chat {MODEL}"]
    (engine,) = [s for s in spans if s["name"] == "llm_request"]
    assert server["parent_id"] == f"{client_span:016x}"
    assert attempt["parent_id"] == server["context"]["span_id"]
    # vLLM's span is the child of the router's attempt: the traceparent the router sent.
    assert engine["parent_id"] == attempt["context"]["span_id"]
    assert engine["context"]["trace_id"] == f"{trace_id:032x}"
    # Both count the same tokens.
    usage = answer["usage"]
    assert attempt["attributes"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert engine["attributes"]["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
