"""Clients that stream through a router without pause, and a tally of what happened to each request.

Every request is recorded with its start and end (monotonic seconds), whether it succeeded (HTTP 200
and a stream that ended with ``[DONE]``) and, if not, why. A test splits the records around the
moment it broke something: requests that started after it must all succeed; those in flight at that
moment are counted and reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True, slots=True)
class Record:
    client: int
    start: float
    end: float
    ok: bool
    why: str = ""


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
    """``clients`` concurrent streaming clients hitting ``base_url`` until :meth:`stop`."""

    base_url: str
    key: str
    model: str = "chat"
    clients: int = 4
    max_tokens: int = 12
    timeout_s: float = 20.0
    records: list[Record] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def one(self, http: httpx.AsyncClient, client: int) -> Record:
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

    async def _client(self, client: int) -> None:
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=1)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as http:
            while not self._stop.is_set():
                self.records.append(await self.one(http, client))

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


async def wait_serving(base_url: str, key: str, model: str = "chat", timeout: float = 60.0) -> None:
    """Poll until one non-streamed completion through the router succeeds."""
    deadline = time.monotonic() + timeout
    last = ""
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            try:
                r = await http.post(
                    f"{base_url}/v1/chat/completions",
                    json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                    headers={"Authorization": f"Bearer {key}"},
                )
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            await asyncio.sleep(0.2)
    raise AssertionError(f"{model} not served through {base_url} within {timeout:.0f}s: {last}")
