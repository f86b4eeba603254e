"""The router's API beyond chat: every path vLLM serves is routed by its model, refused in the client's
own dialect, and never sent to a model that does not serve it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from llmgw_router.dialects.dialect import AUDIO, MESSAGES
from llmgw_router.dialects.routes import PROXIED
from llmgw_router.routing.endpoints import tag_of
from llmgw_router.service import Router
from llmgw_runtime.apikeys import generate_key, hash_key
from tests.router.router_helpers import EngineFactory, RouterFactory, StaticFile

KEY = generate_key()
Setup = tuple[Router, str]


@pytest.fixture
async def setup(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> AsyncIterator[Setup]:
    gen = await engines("gen")
    emb = await engines("emb")
    static = static_file({"gen": [gen.url], "emb": [emb.url]}, keys=[{"name": "k", "hash": hash_key(KEY)}])
    static["models"][0]["apis"] = ["chat", "completions", "responses", "messages"]
    static["models"][1]["apis"] = ["embeddings"]
    r = await routers(static)
    yield r, f"http://127.0.0.1:{r.port}"


async def _post(s: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    async with s.post(url, json=body, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize(
    "route", [r for r in PROXIED if r.api.value not in ("embeddings",)], ids=lambda r: r.path
)
@pytest.mark.slow
async def test_a_path_the_model_does_not_serve_is_a_404_naming_both(setup: Setup, route: Any) -> None:
    r, base = setup
    hdr = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=hdr) as s:
        if route.dialect is AUDIO:
            form = aiohttp.FormData()
            form.add_field("model", "emb")
            form.add_field("file", b"RIFF", filename="a.wav", content_type="audio/wav")
            async with s.post(base + route.path, data=form) as resp:
                status, body = resp.status, await resp.json()
        else:
            status, body = await _post(s, base + route.path, {"model": "emb", "input": "x"})
    assert status == 404, body
    msg = body["error"]["message"]
    assert "'emb'" in msg and route.path in msg and "it serves: embeddings" in msg
    if route.dialect is MESSAGES:
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    else:
        assert body["error"]["code"] == "unsupported_endpoint"
    # The engine was never asked: nothing is in flight or counted against it.
    assert r.ctx.usage.usage.get("k", {}).get("emb") is None


async def test_anthropic_paths_take_x_api_key_and_refuse_in_anthropics_shape(setup: Setup) -> None:
    _, base = setup
    url = base + "/v1/messages"
    body = {"model": "gen", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        status, got = await _post(s, url, body)
        assert status == 401 and got["type"] == "error" and got["error"]["type"] == "authentication_error"
        status, got = await _post(s, url, body, headers={"x-api-key": "sk-wrong"})
        assert status == 401 and got["error"]["type"] == "authentication_error"
        status, got = await _post(s, url, {**body, "model": "nope"}, headers={"x-api-key": KEY})
        assert status == 404 and got == {
            "type": "error",
            "error": {"type": "not_found_error", "message": got["error"]["message"]},
        }
        status, got = await _post(s, url, [1], headers={"x-api-key": KEY})
        assert status == 400 and got["error"]["type"] == "invalid_request_error"
        async with s.get(url, headers={"x-api-key": KEY}) as resp:
            assert resp.status == 405 and (await resp.json())["error"]["type"] == "invalid_request_error"
        # The same refusal on an OpenAI path keeps OpenAI's shape.
        status, got = await _post(
            s, base + "/v1/chat/completions", {"model": "nope"}, headers={"x-api-key": KEY}
        )
        assert status == 404 and got["error"]["code"] == "model_not_found" and "type" not in got


async def test_a_stored_response_the_router_cannot_place_is_a_clear_404(setup: Setup) -> None:
    _, base = setup
    hdr = {"Authorization": f"Bearer {KEY}"}
    gone = f"resp_lg{tag_of(12345)}abcdef"
    async with aiohttp.ClientSession(headers=hdr) as s:
        for path in ("/v1/responses/resp_abcdef", f"/v1/responses/{gone}"):
            async with s.get(base + path) as resp:
                got = await resp.json()
                assert resp.status == 404 and got["error"]["code"] == "response_not_found", got
        async with s.get(f"{base}/v1/responses/{gone}") as resp:
            assert "the replica that stored it no longer serves" in (await resp.json())["error"]["message"]
        async with s.post(f"{base}/v1/responses/{gone}/cancel") as resp:
            assert resp.status == 404
        async with s.post(f"{base}/v1/responses/{gone}") as resp:
            assert resp.status == 405
        async with s.get(f"{base}/v1/responses/{gone}/other") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
        status, got = await _post(
            s, base + "/v1/responses", {"model": "gen", "input": "hi", "previous_response_id": gone}
        )
        assert status == 404 and "no longer serves" in got["error"]["message"]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/v1/responses/{gone}") as resp:
            assert resp.status == 401


async def test_audio_forms_are_routed_by_their_model_field(setup: Setup) -> None:
    _, base = setup
    hdr = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=hdr) as s:
        form = aiohttp.FormData()
        form.add_field("file", b"RIFF", filename="a.wav", content_type="audio/wav")
        async with s.post(base + "/v1/audio/transcriptions", data=form) as resp:
            got = await resp.json()
            assert resp.status == 400 and "form field named model" in got["error"]["message"]
        form = aiohttp.FormData()
        form.add_field("model", "nope")
        form.add_field("file", b"RIFF", filename="a.wav", content_type="audio/wav")
        async with s.post(base + "/v1/audio/transcriptions", data=form) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
        status, got = await _post(s, base + "/v1/audio/transcriptions", {"model": "gen"})
        assert status == 400 and "multipart/form-data" in got["error"]["message"]
