"""A key's limits through a real router and sim engines, read by the official SDKs: 429 with OpenAI's
body and x-ratelimit headers (Anthropic's shape on /v1/messages), reset on the UTC minute and day of
a clock the test moves, concurrency released when a request ends, keys without limits untouched."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from llmgw_common.messages import ApiKeyRecord, KeyLimits, Limits
from llmgw_router.service import Router
from llmgw_runtime.apikeys import generate_key, hash_key
from tests.router.router_helpers import EngineFactory, RouterFactory, StaticFile

FREE = generate_key()
LIMITED = generate_key()
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


class Clock:
    def __init__(self, text: str) -> None:
        self.now = datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()

    def __call__(self) -> float:
        return self.now


Setup = tuple[Router, str, Clock]


@pytest.fixture
async def setup(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> AsyncIterator[Setup]:
    fast = await engines("fast")
    slow = await engines("slow", ttft_ms=1500, tokens_per_s=50)
    static = static_file(
        {"fast": [fast.url], "slow": [slow.url]}, keys=[{"name": "free", "hash": hash_key(FREE)}]
    )
    static["models"][0]["apis"] = ["chat", "completions", "messages"]
    r = await routers(static)
    clock = Clock("2026-12-01T16:00:00")
    r.ctx.clock = clock
    yield r, f"http://127.0.0.1:{r.port}", clock


def limit(r: Router, limits: KeyLimits) -> ApiKeyRecord:
    """The limited key's record, as the bucket would bring it (a static file has no limits)."""
    rec = ApiKeyRecord(id="k-lim", name="batch", hash=hash_key(LIMITED), created=0.0, limits=limits)
    r.ctx.keys.put(rec)
    return rec


def client(base: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


async def test_rpm_refusal_as_the_openai_sdk_reads_it_and_reset_at_the_minute(setup: Setup) -> None:
    r, base, clock = setup
    limit(r, KeyLimits(rpm=2))
    c, free = client(base, LIMITED), client(base, FREE)
    clock.now += 15
    for _ in range(2):
        await c.chat.completions.create(model="fast", messages=MSG, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as e:
        await c.chat.completions.create(model="fast", messages=MSG, max_tokens=2)
    err = e.value
    assert err.status_code == 429 and err.code == "rate_limit_exceeded"
    assert "key 'batch' is at its limit of 2 requests per minute" in err.message
    assert "resets at 2026-12-01T16:01:00Z, in 45s" in err.message
    h = err.response.headers
    assert h["retry-after"] == "45"
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("2", "0")
    assert h["x-ratelimit-reset-requests"] == "45s"
    # Another key is untouched by this one's limit, many times over.
    for _ in range(6):
        await free.chat.completions.create(model="fast", messages=MSG, max_tokens=2)
    clock.now += 45  # 16:01:00: a new minute
    await c.chat.completions.create(model="fast", messages=MSG, max_tokens=2)
    assert r.ctx.quota.meters["k:k-lim"].requests == 1
    await c.close()
    await free.close()


async def test_tokens_per_minute_counted_from_answers_and_streams(setup: Setup) -> None:
    r, base, clock = setup
    limit(r, KeyLimits(tpm=30, models={"fast": Limits(rpm=100)}))
    c = client(base, LIMITED)
    got = await c.chat.completions.create(model="fast", messages=MSG, max_tokens=5)
    assert got.usage is not None
    used = got.usage.prompt_tokens + got.usage.completion_tokens
    stream = await c.chat.completions.create(
        model="fast",
        messages=MSG,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for ev in stream:
        if ev.usage is not None:
            used += ev.usage.prompt_tokens + ev.usage.completion_tokens
    assert r.ctx.quota.meters["k:k-lim"].tokens == used
    while r.ctx.quota.meters["k:k-lim"].tokens < 30:
        await c.chat.completions.create(model="fast", messages=MSG, max_tokens=5)
    with pytest.raises(openai.RateLimitError) as e:
        await c.chat.completions.create(model="fast", messages=MSG, max_tokens=5)
    assert "30 tokens per minute" in e.value.message
    h = e.value.response.headers
    assert h["x-ratelimit-limit-tokens"] == "30" and h["x-ratelimit-remaining-tokens"] == "0"
    assert h["x-ratelimit-reset-tokens"] == "1m0s" and h["x-ratelimit-limit-requests"] == "100"
    clock.now += 60
    await c.chat.completions.create(model="fast", messages=MSG, max_tokens=5)
    await c.close()


async def test_a_spent_daily_budget_is_insufficient_quota_until_utc_midnight(setup: Setup) -> None:
    r, base, clock = setup
    limit(r, KeyLimits(daily_tokens=1))
    c = client(base, LIMITED)
    await c.completions.create(model="fast", prompt="hi", max_tokens=3)
    clock.now += 7 * 3600 + 59 * 60 + 59  # 23:59:59
    with pytest.raises(openai.RateLimitError) as e:
        await c.completions.create(model="fast", prompt="hi", max_tokens=3)
    assert e.value.code == "insufficient_quota" and "daily budget of 1 tokens" in e.value.message
    assert e.value.response.headers["retry-after"] == "1"
    clock.now += 1
    await c.completions.create(model="fast", prompt="hi", max_tokens=3)
    await c.close()


@pytest.mark.slow
async def test_concurrency_is_held_while_a_request_runs_and_released_after(setup: Setup) -> None:
    r, base, _ = setup
    limit(r, KeyLimits(concurrency=1))
    c = client(base, LIMITED)
    first = asyncio.create_task(c.chat.completions.create(model="slow", messages=MSG, max_tokens=2))
    meter = None
    for _ in range(200):
        meter = r.ctx.quota.meters.get("k:k-lim")
        if meter is not None and meter.in_flight == 1:
            break
        await asyncio.sleep(0.01)
    assert meter is not None and meter.in_flight == 1
    with pytest.raises(openai.RateLimitError) as e:
        await c.chat.completions.create(model="slow", messages=MSG, max_tokens=2)
    assert "limit of 1 concurrent requests" in e.value.message
    assert e.value.response.headers["retry-after"] == "1"
    await first
    assert meter.in_flight == 0
    await c.chat.completions.create(model="fast", messages=MSG, max_tokens=2)
    assert meter.in_flight == 0
    await c.close()


async def test_anthropic_paths_refuse_in_anthropics_shape_with_the_same_headers(setup: Setup) -> None:
    r, base, _ = setup
    limit(r, KeyLimits(rpm=1))
    c = anthropic.AsyncAnthropic(base_url=base, api_key=LIMITED, max_retries=0)
    await c.messages.create(model="fast", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.RateLimitError) as e:
        await c.messages.create(model="fast", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 429
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error" and "1 requests per minute" in body["error"]["message"]
    h = e.value.response.headers
    assert h["retry-after"] == "60" and h["x-ratelimit-limit-requests"] == "1"
    await c.close()


async def test_a_served_answer_carries_the_x_ratelimit_headers_too(setup: Setup) -> None:
    """OpenAI sends x-ratelimit-* on every answer; a client paces itself by them before any 429."""
    r, base, clock = setup
    limit(r, KeyLimits(rpm=5, tpm=10_000))
    clock.now += 20
    c, free = client(base, LIMITED), client(base, FREE)
    raw = await c.chat.completions.with_raw_response.create(model="fast", messages=MSG, max_tokens=2)
    h = raw.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("5", "4")
    assert h["x-ratelimit-reset-requests"] == "40s"
    assert h["x-ratelimit-limit-tokens"] == "10000"
    stream = await c.chat.completions.with_raw_response.create(
        model="fast", messages=MSG, max_tokens=2, stream=True
    )
    assert stream.headers["x-ratelimit-remaining-requests"] == "3"
    async for _ in stream.parse():
        pass
    # A key without limits gets none (nothing to pace by).
    plain = await free.chat.completions.with_raw_response.create(model="fast", messages=MSG, max_tokens=2)
    assert "x-ratelimit-limit-requests" not in plain.headers


@pytest.mark.slow
async def test_a_long_stream_weighs_on_tokens_per_minute_while_it_runs(setup: Setup) -> None:
    """Completion tokens are counted as they stream: a second request is refused while the first is
    still streaming past the key's tokens per minute, not only once it ends."""
    r, base, clock = setup
    limit(r, KeyLimits(tpm=30))
    clock.now += 5
    c = client(base, LIMITED)
    stream = await c.chat.completions.create(
        model="slow", messages=MSG, max_tokens=150, stream=True, stream_options={"include_usage": True}
    )
    seen = 0
    async for chunk in stream:
        seen += 1 if chunk.choices else 0
        if seen == 40:
            break
    with pytest.raises(openai.RateLimitError) as e:
        await c.chat.completions.create(model="fast", messages=MSG, max_tokens=2)
    assert "its limit of 30 tokens per minute" in e.value.message
    await stream.close()
