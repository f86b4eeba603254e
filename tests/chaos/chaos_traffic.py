"""Clients that stream through a router without pause, and a tally of what happened to each request.

Every request is recorded with its start and end (monotonic seconds), whether it succeeded (HTTP 200
and a stream that ended with ``[DONE]``) and, if not, why. A test splits the records around the
moment it broke something: requests that started after it must all succeed; those in flight at that
moment are counted and reported.

With ``verify``, each client asks with its own words and every stream is checked against the simulated
engine's uninterrupted answer to that request (text, one id, one finish_reason, usage); the largest gap
between two of a stream's events, and when it began, are recorded (a migration's pause).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from llmgw_sim import openai_api as oai
from tests.chaos.chaos_bus import BusView
from tests.http_clients import async_client
from tests.kit.poll import eventually


@dataclass(frozen=True, slots=True)
class Record:
    client: int
    start: float
    end: float
    ok: bool
    why: str = ""
    # The longest pause between two events of the stream, and when it began (verify mode only).
    gap: float = 0.0
    gap_at: float = 0.0


@dataclass
class Tally:
    """Counts of a set of records, for printing and for assertion messages."""

    label: str
    records: list[Record]

    @property
    def ok(self) -> int:
        return sum(1 for r in self.records if r.ok)

    @property
    def failed(self) -> list[Record]:
        return [r for r in self.records if not r.ok]

    def line(self) -> str:
        whys = Counter(r.why for r in self.failed)
        reasons = "; ".join(f"{n}x {w}" for w, n in whys.most_common(5))
        return f"{self.label}: {len(self.records)} requests, {self.ok} ok, {len(self.failed)} failed" + (
            f" ({reasons})" if reasons else ""
        )


@dataclass
class Traffic:
    """``clients`` concurrent streaming clients hitting ``base_url`` until :meth:`stop`, each pausing
    ``pause_s`` between its requests.

    The pause is what keeps traffic from taking the cores the cluster under test needs: a client with
    none sends its next 12-token stream the moment the last ends (about 55 ms on the simulator), and
    on a saturated 2-core box such loops take whatever CPU is left from everything else. With 0.1 s a
    client still has a request in flight about a third of the time, so four of them leave few moments
    uncovered; a test whose point is load (autoscaling) passes 0.
    """

    base_url: str
    key: str
    model: str = "chat"
    clients: int = 4
    max_tokens: int = 12
    timeout_s: float = 20.0
    verify: bool = False
    pause_s: float = 0.1
    records: list[Record] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def one(self, http: httpx.AsyncClient, client: int) -> Record:
        if self.verify:
            return await self._verified(http, client)
        t0 = time.monotonic()
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "chaos"}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        try:
            async with http.stream(
                "POST",
                f"{self.base_url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {self.key}"},
            ) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")[:160]
                    return Record(client, t0, time.monotonic(), False, f"HTTP {r.status_code}: {text}")
                done = False
                async for line in r.aiter_lines():
                    if line.strip() == "data: [DONE]":
                        done = True
                if not done:
                    return Record(client, t0, time.monotonic(), False, "stream ended without [DONE]")
        except httpx.HTTPError as e:
            return Record(client, t0, time.monotonic(), False, f"{type(e).__name__}: {e}"[:160])
        return Record(client, t0, time.monotonic(), True)

    async def _verified(self, http: httpx.AsyncClient, client: int) -> Record:
        t0 = time.monotonic()
        n = len(self.records)
        body = {
            "model": self.model,
            # Distinct words per request: a lost or repeated piece shifts the answer's cycle.
            "messages": [{"role": "user", "content": f"chaos c{client} r{n} k{client * 7 + n}"}],
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        g = oai.read_chat(body, 16)
        want = oai.completion_tokens(g)
        stamps: list[float] = []
        events: list[dict[str, Any] | str] = []
        try:
            async with http.stream(
                "POST",
                f"{self.base_url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {self.key}"},
            ) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")[:160]
                    return Record(client, t0, time.monotonic(), False, f"HTTP {r.status_code}: {text}")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        stamps.append(time.monotonic())
                        payload = line[6:]
                        events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
        except httpx.HTTPError as e:
            return Record(client, t0, time.monotonic(), False, f"{type(e).__name__}: {e}"[:160])
        gap, gap_at = max(((b - a, a) for a, b in itertools.pairwise(stamps)), default=(0.0, 0.0))
        why = stream_problem(events, "".join(want), (g.prompt_tokens, len(want)))
        return Record(client, t0, time.monotonic(), not why, why, gap, gap_at)

    async def _client(self, client: int) -> None:
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=1)
        async with async_client(timeout=self.timeout_s, limits=limits) as http:
            while not self._stop.is_set():
                self.records.append(await self.one(http, client))
                if self.pause_s > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), self.pause_s)

    def start(self) -> Traffic:
        self._tasks = [asyncio.create_task(self._client(i), name=f"traffic-{i}") for i in range(self.clients)]
        return self

    async def stop(self) -> None:
        """Let every client finish the request it is in, then stop."""
        self._stop.set()
        done, pending = await asyncio.wait(self._tasks, timeout=self.timeout_s + 5)
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for t in done:
            t.result()

    async def run_for(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    # ------------------------------------------------------------ splitting around an event

    def started_after(self, t: float, label: str = "started after") -> Tally:
        return Tally(label, [r for r in self.records if r.start >= t])

    def in_flight_at(self, t: float, label: str = "in flight") -> Tally:
        return Tally(label, [r for r in self.records if r.start < t < r.end])

    def ended_before(self, t: float, label: str = "ended before") -> Tally:
        return Tally(label, [r for r in self.records if r.end <= t])

    def between(self, t0: float, t1: float, label: str) -> Tally:
        return Tally(label, [r for r in self.records if t0 <= r.start < t1])

    def all(self, label: str = "all") -> Tally:
        return Tally(label, list(self.records))


def stream_problem(events: list[dict[str, Any] | str], text: str, usage: tuple[int, int]) -> str:
    """What is wrong with a chat stream against the answer it should carry ("" when nothing)."""
    if events.count("[DONE]") != 1 or events[-1] != "[DONE]":
        return f"{events.count('[DONE]')} [DONE] events, the last one last: {events[-1:] == ['[DONE]']}"
    chunks = [e for e in events if isinstance(e, dict)]
    if len({(c.get("id"), c.get("created"), c.get("model")) for c in chunks}) != 1:
        return "more than one id/created/model"
    got = ""
    finishes = []
    for c in chunks:
        for ch in c["choices"]:
            got += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finishes.append(ch["finish_reason"])
    if got != text:
        at = next(
            (i for i, (a, b) in enumerate(zip(got, text, strict=False)) if a != b), min(len(got), len(text))
        )
        return f"text differs from the uninterrupted answer at char {at} ({len(got)} vs {len(text)} chars)"
    if len(finishes) != 1:
        return f"{len(finishes)} finish_reasons"
    u = chunks[-1].get("usage")
    if not isinstance(u, dict) or (u.get("prompt_tokens"), u.get("completion_tokens")) != usage:
        return f"usage {u} is not {usage}"
    return ""


async def streams_on(view: BusView, model: str, node: str) -> float:
    """Requests the node's engine for ``model`` is running now, from its own /metrics (0 if none)."""
    eps = await view.endpoints()
    urls = [e.url for e in (eps.endpoints.get(model, ()) if eps else ()) if e.node == node]
    if not urls:
        return 0.0
    async with async_client(timeout=2) as http:
        text = (await http.get(urls[0] + "/metrics")).text
    return next(
        (float(x.split()[-1]) for x in text.splitlines() if x.startswith("vllm:num_requests_running")), 0.0
    )


async def wait_serving(base_url: str, key: str, model: str = "chat", timeout: float = 60.0) -> None:
    """Wait until one non-streamed completion through the router succeeds."""
    last = ""

    async def served() -> bool:
        nonlocal last
        r = await http.post(
            f"{base_url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        )
        last = f"HTTP {r.status_code}: {r.text[:200]}"
        return r.status_code == 200

    async with async_client(timeout=5) as http:
        try:
            await eventually(
                served,
                timeout=timeout,
                every=0.2,
                what=f"{model} to be served through {base_url}",
                tolerate=(httpx.HTTPError,),
            )
        except AssertionError as e:
            raise AssertionError(f"{e}; last answer: {last or '-'}") from None
