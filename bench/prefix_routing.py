"""Prefix-aware routing, measured: time to first token with and without, two real llama.cpp replicas.

Two ``llama-server`` processes (the Gemma 3 270M GGUF of ``make llama``, CPU) behind two routers over
the same pair: one routes least-loaded (power of two choices), one with ``prefix_affinity`` on. A
multi-turn workload: ``--conversations`` concurrent conversations of ``--turns`` turns each, every one
with its own long system prompt, each turn sending the whole conversation so far (streamed; TTFT is the
time to the first ``data:`` chunk). Phases alternate (off, on, off, on, ...) with fresh conversations
each, so one phase's KV caches cannot help another and a busy machine loads both modes alike.

    make llama                                               # llama-server and the GGUF, once
    .venv/bin/python bench/prefix_routing.py                 # about 5 minutes on 2 busy cores
    .venv/bin/python bench/prefix_routing.py --rounds 1 --think-s 0   # without users' pauses

Prints TTFT p50/p90 of turns after the first (the first turn of a conversation is a cache miss in both
modes), and of all turns, per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "llama"))
from llama_kit import find_gguf, find_llama_server, free_port

MODEL = "bench"
WORDS = (
    "river stone lantern orbit maple copper signal harbor velvet quarry meadow cipher tundra falcon "
    "ember glacier mosaic pepper saddle timber violet walnut zephyr beacon canyon dune fern grove"
).split()


def start_llama(
    binary: Path, gguf: Path, log: Path, ctx: int, slots: int
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--metrics"]
    # --swa-full: Gemma 3 uses sliding-window attention, whose cache llama.cpp can reuse for a prefix only
    # when kept at full size; a deployment that wants prefix caching with such a model sets it too.
    argv += ["--alias", MODEL, "-ngl", "0", "-c", str(ctx), "-np", str(slots), "-t", "1", "--swa-full"]
    with log.open("wb") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return p, f"http://127.0.0.1:{port}"


def start_router(static: Path, affinity: bool, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ, LLMGW_LOG_LEVEL="WARNING", LLMGW_PREFIX_AFFINITY=str(affinity).lower())
    argv = [sys.executable, "-m", "llmgw_cli", "router", "--static", str(static), "--port", str(port)]
    argv += ["--router-id", f"bench-{'on' if affinity else 'off'}"]
    with log.open("wb") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return p, f"http://127.0.0.1:{port}"


def stop(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


async def wait_ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


def system_prompt(rng: random.Random, words: int) -> str:
    return "You are a careful assistant. Background notes: " + " ".join(
        rng.choice(WORDS) for _ in range(words)
    )


async def turn(
    s: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str]:
    """One streamed turn: (seconds to the first data chunk, the reply's text)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            for ch in json.loads(line[6:]).get("choices", ()):
                text.append((ch.get("delta") or {}).get("content") or "")
    assert ttft is not None
    return ttft, "".join(text)


async def phase(
    url: str, seed: int, conversations: int, turns: int, words: int, max_tokens: int, think_s: float = 0.0
) -> list[tuple[int, float]]:
    """(turn index, ttft) of every request of ``conversations`` concurrent conversations; a user thinks
    between 0.5 and 1.5 x ``think_s`` before each next turn. Without think time least-loaded routing is
    sticky by accident: a conversation's next turn follows the moment its last one left its replica,
    which is then the less loaded one."""
    out: list[tuple[int, float]] = []

    async def conversation(i: int, s: aiohttp.ClientSession) -> None:
        rng = random.Random(seed * 1000 + i)
        msgs = [{"role": "system", "content": system_prompt(rng, words)}]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"Question {t}: what about the {rng.choice(WORDS)}?"})
            ttft, reply = await turn(s, url, msgs, max_tokens)
            out.append((t, ttft))
            msgs.append({"role": "assistant", "content": reply})
            await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(conversation(i, s) for i in range(conversations)))
    return out


async def prompt_tokens(urls: list[str]) -> list[float]:
    """Prompt tokens each engine computed so far (llama.cpp's counter: cached tokens are not in it)."""
    out = []
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.get(f"{u}/metrics") as r:
                lines = (await r.text()).splitlines()
            out.append(
                sum(float(x.split()[-1]) for x in lines if x.startswith("llamacpp:prompt_tokens_total"))
            )
    return out


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


async def main(a: argparse.Namespace) -> None:
    binary, why = find_llama_server()
    gguf, why2 = find_gguf()
    if binary is None or gguf is None:
        sys.exit(f"needs llama-server and the GGUF (make llama): {why or why2}")
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-prefix-") as tmp:
        d = Path(tmp)
        try:
            urls = []
            for i in range(2):
                p, u = start_llama(binary, gguf, d / f"llama{i}.log", a.ctx, a.slots)
                procs.append(p)
                urls.append(u)
            for u in urls:
                await wait_ready(u)
            static = d / "static.yaml"
            static.write_text(f"models:\n  - {{name: {MODEL}, endpoints: [{', '.join(urls)}]}}\n")
            routers = {}
            for on in (False, True):
                p, u = start_router(static, on, d / f"router-{on}.log")
                procs.append(p)
                routers[on] = u
            for u in routers.values():
                await wait_ready(u, 30)
            # Warm both engines (first-request costs) before measuring.
            await phase(routers[False], 999, 2, 1, 20, 4)
            results: dict[bool, list[tuple[int, float]]] = {False: [], True: []}
            computed: dict[bool, list[float]] = {False: [0.0, 0.0], True: [0.0, 0.0]}
            seed = 0
            for r in range(a.rounds):
                for on in (False, True) if r % 2 == 0 else (True, False):
                    seed += 1
                    t0 = time.monotonic()
                    tok0 = await prompt_tokens(urls)
                    res = await phase(
                        routers[on], seed, a.conversations, a.turns, a.words, a.max_tokens, a.think_s
                    )
                    results[on] += res
                    tok1 = await prompt_tokens(urls)
                    computed[on] = [c + b - a for c, a, b in zip(computed[on], tok0, tok1, strict=True)]
                    later = [x for t, x in res if t > 0]
                    print(
                        f"round {r} affinity={'on ' if on else 'off'}: {len(res)} requests in "
                        f"{time.monotonic() - t0:.1f}s, TTFT p50 later turns {pct(later, 0.5) * 1000:.0f} ms",
                        flush=True,
                    )
            summary: dict[str, Any] = {}
            for on, res in results.items():
                later = [x for t, x in res if t > 0]
                every = [x for _, x in res]
                summary["on" if on else "off"] = {
                    "requests": len(res),
                    "prompt_tokens_computed_per_engine": [round(x) for x in computed[on]],
                    "ttft_p50_later_ms": round(pct(later, 0.5) * 1000),
                    "ttft_p90_later_ms": round(pct(later, 0.9) * 1000),
                    "ttft_p50_all_ms": round(pct(every, 0.5) * 1000),
                    "ttft_p90_all_ms": round(pct(every, 0.9) * 1000),
                }
            print(json.dumps(summary, indent=2))
        finally:
            for p in procs:
                stop(p)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="pairs of phases (off and on)")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--words", type=int, default=400, help="words of each conversation's system prompt")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--think-s", type=float, default=2.0, help="mean pause between a reply and the next turn")
    ap.add_argument("--ctx", type=int, default=16384, help="llama-server context (split over its slots)")
    ap.add_argument("--slots", type=int, default=4, help="llama-server parallel slots")
    asyncio.run(main(ap.parse_args()))
