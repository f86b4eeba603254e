"""What the pinned llama-server serves beyond chat, routed by a router in front of the real thing:
Anthropic Messages (SDK, plain and streamed), the stateless Responses API, tokenize/detokenize, and a
clear 404 for what it does not serve (embeddings without ``--embeddings``; chat on an embedding
server). ``llmgw_common.apis`` says what each flag set serves; this holds it to the server."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import yaml

from llmgw_router.service import Router
from llmgw_router.settings import RouterSettings
from tests.kit.poll import eventually
from tests.llama.llama_kit import clean_env, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("llama"), pytest.mark.timeout(300)]

BASE_ARGS = ["--threads", "1", "--ctx-size", "1024", "--parallel", "1"]


def _start(
    server: Path, gguf: Path, alias: str, extra: list[str], log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", alias]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*argv, *BASE_ARGS, *extra], stdout=out, stderr=subprocess.STDOUT, env=clean_env()
        )
    return proc, f"http://127.0.0.1:{port}"


async def _llama(
    server: Path, gguf: Path, alias: str, extra: list[str], log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    proc, url = _start(server, gguf, alias, extra, log)

    async def healthy() -> bool:
        assert proc.poll() is None, f"llama-server {alias} exited ({proc.returncode}): see {log}"
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            return r.status == 200

    await eventually(
        healthy, timeout=120, every=0.25, tolerate=(aiohttp.ClientError,), what=f"llama-server {alias}"
    )
    return proc, url


@pytest.fixture
async def router(llama_server: Path, gguf: Path, tmp_path: Path) -> AsyncIterator[str]:
    gen, gen_url = await _llama(llama_server, gguf, "gemma", [], tmp_path / "gen.log")
    emb, emb_url = await _llama(
        llama_server, gguf, "gemma-emb", ["--embeddings", "--pooling", "mean"], tmp_path / "emb.log"
    )
    models: list[dict[str, Any]] = [
        {"name": "gemma", "engine": "llamacpp", "endpoints": [gen_url]},
        {
            "name": "gemma-emb",
            "engine": "llamacpp",
            "args": ["--embeddings", "--pooling", "mean"],
            "endpoints": [emb_url],
        },
    ]
    path = tmp_path / "static.yaml"
    path.write_text(yaml.safe_dump({"auth": False, "models": models}))
    r = Router(RouterSettings(port=0, router_id="rt-llama", static_file=str(path)))
    await r.start()
    try:
        yield f"http://127.0.0.1:{r.port}"
    finally:
        await r.stop()
        for p in (gen, emb):
            p.kill()
            p.wait()


async def test_llama_server_surface_through_the_router(router: str) -> None:
    client = anthropic.AsyncAnthropic(base_url=router, api_key="-", max_retries=0, timeout=120)
    msg = await client.messages.create(
        model="gemma", max_tokens=8, messages=[{"role": "user", "content": "Say hello"}]
    )
    assert msg.type == "message" and msg.content and msg.usage.output_tokens > 0
    async with client.messages.stream(
        model="gemma", max_tokens=6, messages=[{"role": "user", "content": "Count to three"}]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
    assert text
    oai = openai.AsyncOpenAI(base_url=router + "/v1", api_key="-", max_retries=0, timeout=120)
    resp = await oai.responses.create(model="gemma", input="Say hi", max_output_tokens=8)
    assert resp.output_text
    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/tokenize", json={"model": "gemma", "content": "hello world"}) as r:
            tokens = (await r.json())["tokens"]
            assert r.status == 200 and tokens
        async with s.post(router + "/detokenize", json={"model": "gemma", "tokens": tokens}) as r:
            assert r.status == 200 and "hello world" in (await r.json())["content"]
        # Not served by this engine with these flags: the router says so, the engine is never asked.
        async with s.post(router + "/v1/embeddings", json={"model": "gemma", "input": "x"}) as r:
            body = await r.json()
            assert r.status == 404 and body["error"]["code"] == "unsupported_endpoint", body
        async with s.post(
            router + "/v1/chat/completions",
            json={"model": "gemma-emb", "messages": [{"role": "user", "content": "x"}]},
        ) as r:
            assert r.status == 404 and "'gemma-emb'" in (await r.json())["error"]["message"]
        async with s.post(router + "/v1/embeddings", json={"model": "gemma-emb", "input": ["a", "b"]}) as r:
            got = await r.json()
            assert r.status == 200 and len(got["data"]) == 2 and len(got["data"][0]["embedding"]) > 0
        # llama.cpp keeps no responses: its own 400 for previous_response_id is relayed as it said it.
        async with s.post(
            router + "/v1/responses", json={"model": "gemma", "input": "x", "previous_response_id": "resp_1"}
        ) as r:
            assert r.status == 400 and "previous_response_id" in (await r.text())
    await client.close()
    await oai.close()
