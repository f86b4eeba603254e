"""bench/kv_routing.py's workloads and measurements: seeded scripts, the streaming client, engine counters.

A workload is a list of :class:`Session` scripts, each a closed loop (one request at a time, the next
after the answer and a pause). Every prompt a case sends starts with the case's own tag, so no case
can reuse another's cached blocks, while every target sees the same shapes and sizes (same seed).

- ``chat``: conversations sharing a few long system prompts, each turn re-sending the whole history,
  users pausing between turns (~``think_s``); ``chat-closed``: the same without pauses (closed loops,
  where least-loaded routing is sticky by accident, bench/RESULTS.md "Router: prefix affinity");
- ``agent``: agent-like steps, one long context (tools, task) growing by a long tool output per step;
- ``control``: no shared prefixes at all: every request's first word is its own.

The simulator's token is a word (``llmgw_common.simtokens``), so sizes are in words; real tokenizers
make about 1.3 tokens of each of these words.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tests.kit.promtext import samples

from prefix_routing import WORDS, pct  # one word list and one percentile for the prefix benches

# The engines' own counters (vLLM's names; the simulator serves the same): prompt tokens looked up in
# the prefix cache, those found, and every prompt token (the fallback where the cache counters lack).
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
PROMPT = "vllm:prompt_tokens_total"


@dataclass(frozen=True, slots=True)
class Scale:
    """Sizes of one run's workloads (words, counts, seconds)."""

    conversations: int = 24
    turns: int = 6
    groups: int = 4  # distinct system prompts shared by the conversations
    system_words: int = 1500
    user_words: int = 40
    think_s: float = 2.0
    agents: int = 8
    steps: int = 6
    context_words: int = 1800
    tool_words: int = 250
    control_loops: int = 24
    control_requests: int = 6
    max_tokens: int = 24


FULL = Scale()
QUICK = Scale(conversations=8, turns=4, groups=2, system_words=1200, think_s=0.5, agents=4, steps=4,
              context_words=1500, tool_words=200, control_loops=8, control_requests=3, max_tokens=12)  # fmt: skip
# Real vLLM on one core each: a 1,451-token prompt costs 16 s cold (issue 32), so a few short sessions.
VLLM_SMOKE = Scale(conversations=2, turns=3, groups=1, system_words=300, user_words=20, think_s=0.5,
                   agents=1, steps=3, context_words=300, tool_words=60, control_loops=2,
                   control_requests=2, max_tokens=4)  # fmt: skip

# Real vLLM, the regime: each conversation its own ~1,000-token context (a prefill of ~10 s cold
# on one core, ~2 s cached), three turns, pauses between them.
VLLM_LONG = Scale(conversations=4, turns=3, groups=4, system_words=900, user_words=30, think_s=0.5,
                  agents=2, steps=3, context_words=900, tool_words=60, control_loops=2,
                  control_requests=2, max_tokens=4)  # fmt: skip

WORKLOADS = ("chat", "chat-closed", "agent", "control")


@dataclass(frozen=True, slots=True)
class Session:
    system: str
    steps: tuple[str, ...]  # each step's user message
    pauses: tuple[float, ...]  # seconds before each step (the first: a start stagger)
    max_tokens: int
    # A step re-sends the history (chat, agent); False: each step is a conversation of its own (control).
    keep_history: bool = True


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sessions(workload: str, scale: Scale, seed: int, tag: str) -> list[Session]:
    """The scripts of one case: the same for every target given ``seed``; ``tag`` makes its text its own."""
    rng = random.Random(f"{workload}/{seed}")
    head = f"Case {tag}."
    s = scale
    if workload in ("chat", "chat-closed"):
        think = s.think_s if workload == "chat" else 0.0
        systems = [
            f"{head} You are assistant {g}. Notes: {_words(rng, s.system_words)}" for g in range(s.groups)
        ]
        return [
            Session(
                system=systems[i % s.groups],
                steps=tuple(f"Question {t}: {_words(rng, s.user_words)}?" for t in range(s.turns)),
                pauses=(rng.uniform(0, 0.5), *(think * rng.uniform(0.5, 1.5) for _ in range(s.turns - 1))),
                max_tokens=s.max_tokens,
            )
            for i in range(s.conversations)
        ]
    if workload == "agent":
        return [
            Session(
                system=f"{head} Agent {i}. Tools and task: {_words(rng, s.context_words)}",
                steps=tuple(f"Tool output {t}: {_words(rng, s.tool_words)}" for t in range(s.steps)),
                pauses=(rng.uniform(0, 0.5),) + (0.0,) * (s.steps - 1),
                max_tokens=s.max_tokens,
            )
            for i in range(s.agents)
        ]
    if workload == "control":
        # As long as a chat's first turn, but no two requests share even their first block.
        n = s.system_words + s.user_words
        return [
            Session(
                system="",
                steps=tuple(f"{head}{i}.{k} {_words(rng, n)}" for k in range(s.control_requests)),
                pauses=(rng.uniform(0, 0.5),) + (0.0,) * (s.control_requests - 1),
                max_tokens=s.max_tokens,
                keep_history=False,
            )
            for i in range(s.control_loops)
        ]
    raise ValueError(f"unknown workload {workload!r} (one of {', '.join(WORKLOADS)})")


# ---------------------------------------------------------------- the client


@dataclass
class Tally:
    ttft_s: list[float] = field(default_factory=list)
    # Of turns after a conversation's first (whose prefix some replica may hold): the routing's effect.
    later_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> int:
        return len(self.ttft_s)

    def p(self, q: float) -> float:
        return pct(self.ttft_s, q)


async def stream_chat(
    s: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str]:
    """One streamed chat: (seconds to the first token's text, the answer). The first chunk of vLLM and
    the simulator carries only the role, so the clock stops at the first chunk with content."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    async with s.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"status {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", ()):
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    return (time.perf_counter() - t0 if ttft is None else ttft), "".join(text)


async def run_case(
    urls: list[str], headers: dict[str, str], model: str, scripts: list[Session], timeout_s: float
) -> Tally:
    """Every session as its own closed loop; requests go round-robin over ``urls`` (a target's routers),
    so one conversation's turns reach different routers as a load balancer in front would send them."""
    tally = Tally()
    sent = 0

    async def loop(sess: Session, s: aiohttp.ClientSession) -> None:
        nonlocal sent
        msgs = [{"role": "system", "content": sess.system}] if sess.system else []
        for i, (step, pause) in enumerate(zip(sess.steps, sess.pauses, strict=True)):
            await asyncio.sleep(pause)
            ask = [*msgs, {"role": "user", "content": step}]
            url = urls[sent % len(urls)]
            sent += 1
            try:
                ttft, answer = await stream_chat(s, url, model, ask, sess.max_tokens)
            except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as e:
                tally.errors.append(f"{url}: {type(e).__name__}: {e}"[:300])
                return  # a conversation whose answer is lost cannot go on as scripted
            tally.ttft_s.append(ttft)
            if i and sess.keep_history:
                tally.later_s.append(ttft)
            if sess.keep_history:
                msgs = [*ask, {"role": "assistant", "content": answer}]

    t0 = time.monotonic()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=conn, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as s:
        await asyncio.gather(*(loop(x, s) for x in scripts))
    tally.seconds = time.monotonic() - t0
    return tally


# ---------------------------------------------------------------- engine counters


Counters = dict[str, dict[str, float]]  # engine URL -> counter name -> value


async def engine_counters(engines: list[str]) -> Counters:
    """Each engine's prefix-cache and prompt counters (an engine that does not answer is absent)."""
    out: Counters = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for e in engines:
            try:
                async with s.get(f"{e}/metrics") as r:
                    text = await r.text()
            except (aiohttp.ClientError, TimeoutError):
                continue
            mine = out.setdefault(e, {})
            for (name, _), v in samples(text).items():
                if name in (HITS, QUERIES, PROMPT):
                    mine[name] = mine.get(name, 0.0) + v
    return out


def _grew(before: dict[str, float], after: dict[str, float], name: str) -> float:
    # A counter that fell is an engine that restarted (the agent replaced it): it counted from 0.
    a, b = after.get(name, 0.0), before.get(name, 0.0)
    return a - b if a >= b else a


def cache_delta(before: Counters, after: Counters) -> tuple[float | None, float, float]:
    """(prompt tokens the engines computed, tokens looked up, tokens found) between two scrapes:
    queries - hits where the cache counters exist, else every prompt token (no cache: all computed)."""
    computed: float | None = None
    q = h = 0.0
    for e, now in after.items():
        was = before.get(e, {})
        if QUERIES in now and HITS in now:
            eq, eh = _grew(was, now, QUERIES), _grew(was, now, HITS)
            q, h = q + eq, h + eh
            computed = (computed or 0.0) + eq - eh
        elif PROMPT in now:
            computed = (computed or 0.0) + _grew(was, now, PROMPT)
    return computed, q, h
