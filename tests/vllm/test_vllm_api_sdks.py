"""The official SDKs through llmgw's router in front of a real vLLM: the openai SDK's Responses API
(plain, streamed, ``previous_response_id``, retrieve) and the anthropic SDK's Messages (plain and
streamed), as the issue's clients send them. The session's gemma server (vLLM's response store on;
shared with the fidelity module, which runs just before: tests/vllm/conftest.py), a router process in
static mode (the routing is the same code the cluster tests drive)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml

from llmgw_router.stored import untag
from tests.kit.poll import eventually_sync
from tests.llama.llama_kit import free_port
from tests.vllm.vllm_kit import SharedGemma

MODEL = SharedGemma.NAME

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1200)]


def _router_serving(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    def up() -> bool:
        assert proc.poll() is None, f"the router exited ({proc.returncode})"
        try:
            return httpx.get(url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    eventually_sync(up, timeout=timeout, every=0.2, what=f"the router at {url}")


@pytest.fixture(scope="module")
def router_url(shared_gemma: SharedGemma, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = Path(tmp_path_factory.mktemp("vllm-sdks"))
    server = shared_gemma.get()
    router: subprocess.Popen[bytes] | None = None
    try:
        static = {"models": [{"name": MODEL, "engine": "vllm", "endpoints": [server.url]}]}
        (d / "static.yaml").write_text(yaml.safe_dump(static))
        port = free_port()
        with (d / "router.log").open("wb") as log:
            router = subprocess.Popen(
                [sys.executable, "-m", "llmgw_cli", "router", "--static", str(d / "static.yaml"), "--no-auth",
                 "--port", str(port), "--admin-port", "0"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _router_serving(url, router)
        yield url
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)


async def test_openai_responses_through_the_router(router_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=router_url + "/v1", api_key="-", max_retries=0, timeout=300)
    first = await client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8)
    assert first.output_text.strip() and untag(first.id) is not None, first
    nxt = await client.responses.create(
        model=MODEL, input="And another.", previous_response_id=first.id, max_output_tokens=8
    )
    assert nxt.previous_response_id == first.id and nxt.output_text.strip(), nxt
    assert (await client.responses.retrieve(first.id)).output_text == first.output_text
    kinds: list[str] = []
    done_id = ""
    stream = await client.responses.create(
        model=MODEL, input="Count to three.", max_output_tokens=8, stream=True
    )
    async for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.completed":
            done_id = ev.response.id
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds and untag(done_id) is not None
    await client.close()


async def test_anthropic_messages_through_the_router(router_url: str) -> None:
    client = anthropic.AsyncAnthropic(base_url=router_url, api_key="-", max_retries=0, timeout=300)
    msg = await client.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Name a colour."}]
    )
    assert msg.type == "message" and msg.content and msg.usage.output_tokens > 0, msg
    async with client.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Count to three."}]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text.strip() and final.usage.output_tokens > 0, final
    await client.close()
