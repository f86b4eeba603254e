"""LoRA adapters on the simulated engine, as vLLM 0.32 serves them at run time (issue 33): the load and
unload API and its refusals, /v1/models, answers per adapter, the batch's max_loras, the adapters held
in memory, vllm:lora_requests_info, the prefix cache's LoRA salt, and the flags of a real process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw_sim.lora import MAX_INFO_SERIES, Adapters
from llmgw_sim.options import SimOptions
from llmgw_sim.prefix_cache import PrefixCache
from llmgw_sim.serving import Listening
from tests.sim.sim_testkit import EngineProcess, parse_metrics

Make = Callable[..., Awaitable[Listening]]
Spawn = Callable[[SimOptions], Awaitable[EngineProcess]]
MODEL = "sim-model"
PROMPT = "The capital of France is"


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def load(http: aiohttp.ClientSession, srv: Listening | EngineProcess, name: str, path: str = "") -> int:
    status, _ = await post(
        http, srv.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path or f"/w/{name}"}
    )
    return status


async def post_to(
    http: aiohttp.ClientSession, srv: Listening | EngineProcess, path: str, body: Any
) -> tuple[int, Any]:
    return await post(http, srv.url + path, body)


async def text_of(http: aiohttp.ClientSession, srv: Listening | EngineProcess, model: str, n: int = 8) -> str:
    status, body = await post(
        http, srv.url + "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": n}
    )
    assert status == 200, body
    assert body["model"] == model
    text = body["choices"][0]["text"]
    assert isinstance(text, str)
    return text


async def metrics(http: aiohttp.ClientSession, srv: Listening) -> str:
    async with http.get(srv.url + "/metrics") as r:
        return await r.text()


def lora_series(text: str) -> list[tuple[dict[str, str], float]]:
    out: list[tuple[dict[str, str], float]] = []
    for line in text.splitlines():
        if line.startswith("vllm:lora_requests_info{"):
            labels, value = line[len("vllm:lora_requests_info{") :].rsplit("} ", 1)
            pairs = dict(p.split("=", 1) for p in labels.split('",') if p)
            out.append(({k: v.strip('"') for k, v in pairs.items()}, float(value)))
    return out


# ---------------------------------------------------------------- the runtime API


async def test_loaded_adapter_is_a_model_with_its_own_deterministic_answer(
    engine: Make, http: aiohttp.ClientSession
) -> None:
    srv = await engine(zero=True, max_loras=2)
    other = await engine(zero=True, max_loras=2)
    for s in (srv, other):
        assert await load(http, s, "fr") == 200
    assert await load(http, srv, "de") == 200
    base = await text_of(http, srv, MODEL)
    fr = await text_of(http, srv, "fr")
    de = await text_of(http, srv, "de")
    assert len({base, fr, de}) == 3, (base, fr, de)
    # The same adapter answers alike, here and on another engine.
    assert await text_of(http, srv, "fr") == fr
    assert await text_of(http, other, "fr") == fr
    async with http.get(srv.url + "/v1/models") as r:
        cards = (await r.json())["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (MODEL, None, MODEL),
        ("fr", MODEL, "/w/fr"),
        ("de", MODEL, "/w/de"),
    ]


async def test_chat_stream_and_messages_answer_under_the_adapters_name(
    engine: Make, http: aiohttp.ClientSession
) -> None:
    srv = await engine(zero=True, max_loras=1)
    assert await load(http, srv, "fr") == 200
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}
    _, base = await post(http, srv.url + "/v1/chat/completions", {**chat, "model": MODEL})
    status, fr = await post(http, srv.url + "/v1/chat/completions", {**chat, "model": "fr"})
    assert status == 200 and fr["model"] == "fr"
    assert fr["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    async with http.post(srv.url + "/v1/chat/completions", json={**chat, "model": "fr", "stream": True}) as r:
        raw = (await r.read()).decode()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert {c["model"] for c in chunks} == {"fr"}
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == fr["choices"][0]["message"]["content"]
    status, msg = await post(http, srv.url + "/v1/messages", {**chat, "model": "fr"})
    assert status == 200 and msg["model"] == "fr"
    assert msg["content"][0]["text"] == fr["choices"][0]["message"]["content"]


async def test_an_adapter_not_loaded_is_vllms_404_before_and_after(
    engine: Make, http: aiohttp.ClientSession
) -> None:
    srv = await engine(zero=True, max_loras=1)
    want = {
        "message": f"The model `fr` does not exist. Valid aliases: {MODEL}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert await post_to(http, srv, "/v1/completions", {"model": "fr", "prompt": "x"}) == (
        404,
        {"error": want},
    )
    assert await load(http, srv, "fr") == 200
    assert (await post_to(http, srv, "/v1/completions", {"model": "fr", "prompt": "x"}))[0] == 200
    status, text = await post_to(http, srv, "/v1/unload_lora_adapter", {"lora_name": "fr"})
    assert (status, text) == (200, "Success: LoRA adapter 'fr' removed successfully.")
    assert await post_to(http, srv, "/v1/completions", {"model": "fr", "prompt": "x"}) == (
        404,
        {"error": want},
    )
    async with http.get(srv.url + "/v1/models") as r:
        assert [c["id"] for c in (await r.json())["data"]] == [MODEL]


async def test_refusals_of_the_runtime_api_are_vllms(engine: Make, http: aiohttp.ClientSession) -> None:
    srv = await engine(zero=True, max_loras=1)
    assert await load(http, srv, "fr") == 200

    async def refused(path: str, body: Any) -> tuple[int, str, str]:
        status, out = await post_to(http, srv, path, body)
        return status, out["error"]["type"], out["error"]["message"]

    assert await refused("/v1/load_lora_adapter", {"lora_name": "fr", "lora_path": "/w/fr"}) == (
        400,
        "InvalidUserInput",
        "The lora adapter 'fr' has already been loaded. If you want to load the adapter in place, "
        "set 'load_inplace' to True.",
    )
    assert await refused("/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "/w/x"}) == (
        400,
        "InvalidUserInput",
        f"The lora adapter '{MODEL}' conflicts with a served base model.",
    )
    assert await refused("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/w/x"}) == (
        400,
        "InvalidUserInput",
        "Both 'lora_name' and 'lora_path' must be provided.",
    )
    status, out = await post_to(http, srv, "/v1/load_lora_adapter", {"lora_name": "de"})
    assert (status, out["error"]["param"]) == (400, "body.lora_path")
    assert await refused("/v1/unload_lora_adapter", {"lora_name": "zz"}) == (
        404,
        "NotFoundError",
        "The lora adapter 'zz' cannot be found.",
    )
    # In place: the same name from another path.
    body = {"lora_name": "fr", "lora_path": "/w/fr2", "load_inplace": True}
    assert (await post_to(http, srv, "/v1/load_lora_adapter", body))[0] == 200
    async with http.get(srv.url + "/v1/models") as r:
        assert [c["root"] for c in (await r.json())["data"]][1:] == ["/w/fr2"]


async def test_without_max_loras_the_runtime_api_is_not_served(
    engine: Make, http: aiohttp.ClientSession
) -> None:
    srv = await engine(zero=True)
    status, body = await post_to(http, srv, "/v1/load_lora_adapter", {"lora_name": "fr", "lora_path": "/w"})
    assert (status, body) == (404, {"detail": "Not Found"})
    assert "lora_requests_info" not in await metrics(http, srv)


def adapter_dir(root: Path, name: str, rank: int, weights: bool = True) -> Path:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    if weights:
        (d / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return d


async def test_checked_files_fail_as_vllm_fails_them(
    engine: Make, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    srv = await engine(zero=True, max_loras=1, max_lora_rank=8, lora_check_files=True)
    good = adapter_dir(tmp_path, "good", 8)
    wide = adapter_dir(tmp_path, "wide", 16)
    bare = adapter_dir(tmp_path, "bare", 8, weights=False)

    async def attempt(name: str, path: Path) -> tuple[int, Any]:
        return await post_to(http, srv, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    assert (await attempt("good", good))[0] == 200
    status, out = await attempt("wide", wide)
    assert (status, out["error"]["type"]) == (500, "InternalServerError")
    assert out["error"]["message"] == (
        "Call to add_lora method failed: LoRA rank 16 is greater than max_lora_rank 8."
    )
    for name, path in (("gone", tmp_path / "gone"), ("bare", bare)):
        status, out = await attempt(name, path)
        assert (status, out["error"]["type"]) == (404, "NotFoundError"), name
        assert out["error"]["message"] == f"Loading lora {name} failed: No adapter found for <path>"
    async with http.get(srv.url + "/v1/models") as r:
        assert [c["id"] for c in (await r.json())["data"]] == [MODEL, "good"]


@pytest.mark.slow
async def test_a_load_takes_lora_load_s_and_is_not_served_meanwhile(
    engine: Make, http: aiohttp.ClientSession
) -> None:
    srv = await engine(zero=True, max_loras=1, lora_load_s=0.6)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    loading = asyncio.create_task(load(http, srv, "fr"))
    await asyncio.sleep(0.2)
    assert (await post_to(http, srv, "/v1/completions", {"model": "fr", "prompt": "x"}))[0] == 404
    assert await loading == 200
    assert loop.time() - t0 >= 0.55
    assert (await post_to(http, srv, "/v1/completions", {"model": "fr", "prompt": "x"}))[0] == 200


# ---------------------------------------------------------------- the batch and memory


@pytest.mark.slow
async def test_max_loras_holds_a_third_adapters_request_until_one_is_done(
    engine: Make, http: aiohttp.ClientSession
) -> None:
    # 1 s per answer: the first two adapters fill the batch, the third waits for one of them.
    srv = await engine(ttft_ms=0, tokens_per_s=10, max_loras=2, slots=8)
    for name in ("a", "b", "c"):
        assert await load(http, srv, name) == 200
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def timed(model: str) -> float:
        status, _ = await post_to(
            http, srv, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 11}
        )
        assert status == 200
        return loop.time() - t0

    first = [asyncio.create_task(timed(m)) for m in ("a", "b")]
    await asyncio.sleep(0.2)
    third = asyncio.create_task(timed("c"))
    await asyncio.sleep(0.3)
    samples = parse_metrics(await metrics(http, srv))
    assert samples["vllm:num_requests_running"][1] == 2
    assert samples["vllm:num_requests_waiting"][1] == 1
    newest = max(lora_series(await metrics(http, srv)), key=lambda s: s[1])[0]
    assert newest == {"max_lora": "2", "running_lora_adapters": "a,b,c", "waiting_lora_adapters": "a,b,c"}
    done_first = await asyncio.gather(*first)
    done_third = await third
    assert max(done_first) < 3.0
    # It started only after one of the first two ended (~1 s), and took its own second.
    assert done_third >= min(done_first) + 0.9, (done_first, done_third)
    newest = max(lora_series(await metrics(http, srv)), key=lambda s: s[1])[0]
    assert newest["running_lora_adapters"] == ""


@pytest.mark.slow
async def test_an_adapter_dropped_from_memory_is_read_again_by_its_next_request(
    engine: Make, http: aiohttp.ClientSession
) -> None:
    # One adapter held in memory: loading b drops a (still loaded), whose next request reads it again.
    srv = await engine(ttft_ms=0, tokens_per_s=1000, max_loras=1, lora_load_s=1.5)
    assert await load(http, srv, "a") == 200
    assert await load(http, srv, "b") == 200
    loop = asyncio.get_running_loop()

    async def took(model: str) -> float:
        t0 = loop.time()
        assert (
            await post_to(http, srv, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1})
        )[0] == 200
        return loop.time() - t0

    assert await took("b") < 1.0  # held
    assert await took("a") >= 1.45  # read again
    assert await took("a") < 1.0  # held again


async def test_requests_info_keeps_old_label_sets_with_their_time() -> None:
    now = [100.0]
    a = Adapters(MODEL, 2, 2, wall=lambda: now[0])
    assert a.info_series() == [("", 100.0)]
    async with a.request("x"):
        now[0] = 101.0
        assert a.info_series() == [("", 100.0), ("x", 101.0)]
        assert a.busy == ("x",)
    now[0] = 102.0
    assert a.info_series() == [("x", 101.0), ("", 102.0)]
    for i in range(MAX_INFO_SERIES + 5):
        async with a.request(f"n{i}"):
            a.info_series()
    assert len(a.info_series()) == MAX_INFO_SERIES


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    a = Adapters(MODEL, 1, 1, wall=lambda: 0.0)
    async with a.request("x"):
        waiter = asyncio.create_task(a.request("y").__aenter__())
        await asyncio.sleep(0)
        assert a.waiting == 1 and list(a.busy) == ["x", "y"]
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert a.waiting == 0 and list(a.busy) == ["x"]
    assert list(a.busy) == [] and a.active == {}


# ---------------------------------------------------------------- prefix cache


def test_an_adapters_blocks_are_its_own_and_its_events_say_so() -> None:
    cache = PrefixCache(block_size=2, capacity=64)
    tokens = [1, 2, 3, 4, 5]
    base = cache.begin(tokens)
    stored = cache.store(base)
    cache.finish(base)
    lora = cache.begin(tokens, "s", lora="fr")
    assert lora.hit_blocks == 0  # the base's blocks are not the adapter's
    [event] = cache.store(lora)
    assert not set(event.block_hashes) & set(stored[0].block_hashes)  # type: ignore[union-attr]
    assert event.lora_name == "fr"  # type: ignore[union-attr]
    # vLLM's extra keys: the LoRA name on every block, the cache_salt after it on the first.
    assert event.extra_keys == (("fr", "s"), ("fr",))  # type: ignore[union-attr]
    cache.finish(lora)
    again = cache.begin(tokens, "s", lora="fr")
    assert again.hit_blocks == 2


# ---------------------------------------------------------------- options and the process


def test_options_refuse_what_vllm_refuses() -> None:
    with pytest.raises(ValueError, match="max_cpu_loras 1 is less than max_loras 2"):
        SimOptions(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_cpu_loras needs max_loras"):
        SimOptions(max_cpu_loras=4)
    with pytest.raises(ValueError, match="max_loras is 0"):
        SimOptions(max_loras=0)
    with pytest.raises(ValueError, match="lora_load_s is -1"):
        SimOptions(max_loras=1, lora_load_s=-1)
    assert "--max-loras" not in SimOptions().to_argv()
    assert "--max-lora-rank" not in SimOptions().to_argv()
    opts = SimOptions(max_loras=2, max_cpu_loras=4, max_lora_rank=8, lora_load_s=0.5, lora_check_files=True)
    argv = opts.to_argv()
    for flag in ("--max-loras", "--max-cpu-loras", "--max-lora-rank", "--lora-load-s", "--lora-check-files"):
        assert flag in argv
    assert opts.lora_capacity == 4 and SimOptions(max_loras=3).lora_capacity == 3


@pytest.mark.slow
async def test_the_engine_process_takes_the_lora_flags(
    engine_process: Spawn, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    opts = SimOptions(port=0, zero=True, max_loras=1, max_lora_rank=4, lora_check_files=True)
    ep = await engine_process(opts)
    small = adapter_dir(tmp_path, "fr", 4)
    wide = adapter_dir(tmp_path, "wide", 8)
    assert await load(http, ep, "fr", str(small)) == 200
    assert await load(http, ep, "wide", str(wide)) == 500
    assert (await text_of(http, ep, "fr")) != (await text_of(http, ep, MODEL))
    assert 'max_lora="1"' in (await (await http.get(ep.url + "/metrics")).text())


# ---------------------------------------------------------------- continuation


async def test_a_stream_continued_elsewhere_keeps_its_adapters_answer(
    engine: Make, http: aiohttp.ClientSession
) -> None:
    # A router continuing a broken stream on another replica sends the text so far as the final
    # assistant message: with the same adapter the rest is the rest of that adapter's answer.
    first, other = await engine(zero=True, max_loras=1), await engine(zero=True, max_loras=1)
    for srv in (first, other):
        assert await load(http, srv, "fr") == 200
    user = [{"role": "user", "content": PROMPT}]
    _, whole = await post_to(
        http, first, "/v1/chat/completions", {"model": "fr", "messages": user, "max_tokens": 12}
    )
    text = whole["choices"][0]["message"]["content"]
    cut = " ".join(text.split()[:5])
    body = {
        "model": "fr",
        "messages": [*user, {"role": "assistant", "content": cut}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 7,
    }
    status, rest = await post_to(http, other, "/v1/chat/completions", body)
    assert status == 200 and rest["model"] == "fr"
    assert cut + rest["choices"][0]["message"]["content"] == text
    # The base, continuing the same text, does not say the adapter's rest.
    _, base = await post_to(http, other, "/v1/chat/completions", {**body, "model": MODEL})
    assert cut + base["choices"][0]["message"]["content"] != text
