"""A key kept apart (cache scope team or key) gets a cache_salt of its own at the engine; a client's salt
in the gateway's namespace is refused whatever the key; a shared key's body goes through untouched.

The engine is a real HTTP server that keeps the bodies it got: what is checked is what an engine reads."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from llmgw_common.messages import CacheScope
from llmgw_router.tenancy.salt import salt_for
from llmgw_runtime.apikeys import generate_key, hash_key
from tests.router.router_helpers import CountingUpstream, RouterFactory, StaticFile

SHARED, APART, TEAM_A, TEAM_B = (generate_key() for _ in range(4))


CHAT_ANSWER = {
    "id": "x",
    "object": "chat.completion",
    "choices": [],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def last(eng: CountingUpstream) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(eng.bodies[-1])
    return got


@pytest.fixture
async def setup(
    routers: RouterFactory, static_file: StaticFile
) -> AsyncIterator[tuple[str, CountingUpstream]]:
    async with CountingUpstream(200, answer=CHAT_ANSWER) as eng:
        keys = [
            {"name": "shared", "hash": hash_key(SHARED)},
            {"name": "apart", "id": "k-apart", "hash": hash_key(APART), "cache_scope": "key"},
            # Two keys of no team in team scope: each kept to itself, never sharing with the other.
            {"name": "ta", "id": "k-ta", "hash": hash_key(TEAM_A), "cache_scope": "team"},
            {"name": "tb", "id": "k-tb", "hash": hash_key(TEAM_B), "cache_scope": "team"},
        ]
        static = static_file({"m": [eng.url]}, keys=keys)
        static["models"][0]["apis"] = ["chat", "completions", "messages", "embeddings"]
        r = await routers(static)
        yield f"http://127.0.0.1:{r.port}", eng


async def post(base: str, key: str, path: str, body: dict[str, Any] | bytes) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            base + path,
            data=data,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        ) as r,
    ):
        return r.status, await r.json(content_type=None)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_key_kept_apart_is_salted_with_its_own_and_its_clients_salt_kept(
    setup: tuple[str, CountingUpstream],
) -> None:
    base, eng = setup
    assert (await post(base, APART, "/v1/chat/completions", CHAT))[0] == 200
    assert last(eng)["cache_salt"] == "llmgw:key:k-apart"
    assert (await post(base, APART, "/v1/completions", {"model": "m", "prompt": "x", "cache_salt": "s"}))[
        0
    ] == 200
    assert last(eng)["cache_salt"] == "llmgw:key:k-apart:s"
    # Anthropic's Messages takes vLLM's cache_salt too.
    msg = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert (await post(base, APART, "/v1/messages", msg))[0] == 200
    assert last(eng)["cache_salt"] == "llmgw:key:k-apart"
    # Team scope without a team: each key is kept to itself.
    await post(base, TEAM_A, "/v1/chat/completions", CHAT)
    a = last(eng)["cache_salt"]
    await post(base, TEAM_B, "/v1/chat/completions", CHAT)
    assert a != last(eng)["cache_salt"] and a == "llmgw:key:k-ta"


async def test_a_shared_keys_body_goes_untouched_and_a_forged_salt_is_refused(
    setup: tuple[str, CountingUpstream],
) -> None:
    base, eng = setup
    raw = b'{"model":"m",  "messages":[{"role":"user","content":"hi"}], "cache_salt":"mine"}'
    assert (await post(base, SHARED, "/v1/chat/completions", raw))[0] == 200
    assert eng.bodies[-1] == raw  # not even re-serialised
    n = len(eng.bodies)
    for key in (SHARED, APART):
        status, body = await post(
            base, key, "/v1/chat/completions", {**CHAT, "cache_salt": "llmgw:key:k-apart"}
        )
        assert status == 400 and body["error"]["param"] == "cache_salt"
        assert "reserved for the gateway" in body["error"]["message"]
    status, body = await post(base, APART, "/v1/chat/completions", {**CHAT, "cache_salt": 7})
    assert status == 400 and "cache_salt must be a non-empty string" in body["error"]["message"]
    assert len(eng.bodies) == n  # none of the refused reached the engine


async def test_embeddings_are_not_salted(setup: tuple[str, CountingUpstream]) -> None:
    base, eng = setup
    assert (await post(base, APART, "/v1/embeddings", {"model": "m", "input": "x"}))[0] == 200
    assert "cache_salt" not in last(eng)


def test_salt_for_without_a_key_is_the_clients_own() -> None:
    req: dict[str, Any] = {"cache_salt": "c"}
    assert salt_for(None, req) == "c" and req == {"cache_salt": "c"}
    assert CacheScope("key") is CacheScope.KEY
