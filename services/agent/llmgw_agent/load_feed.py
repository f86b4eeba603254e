"""The engines' load on the bus, fresh (issue 34): read each ready engine every ``scrape_s``, send what
:mod:`llmgw_agent.load_pacing` lets through, in one :class:`~llmgw_common.messages.LoadReport` a tick.

No engine offers its running and waiting counts any better than its ``/metrics`` page (vLLM's KV events
carry blocks, not queues; llama-server has nothing to push), so the agent reads the page often. An
engine slow to answer holds only itself: a tick waits at most ``wait_s`` for the readings it started,
and a reading still under way is taken at a later tick (never two at once for one engine).

Ticks lie on a fixed grid of the loop's clock (a late tick skips the points it missed): the pacing
judges gaps on grid times, which makes ``min_gap_s`` a true bound on each replica's lines.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Generic, Protocol, TypeVar

from llmgw_agent.load_pacing import Key, LoadPacer, Pacing
from llmgw_common.messages import ReplicaLoad

log = logging.getLogger("llmgw.agent.load")


class Scraped(Protocol):
    """What the feed needs of a shard: its key (replica id, shard index)."""

    @property
    def key(self) -> tuple[str, int]: ...


S = TypeVar("S", bound=Scraped)


class LoadFeed(Generic[S]):
    """Reads the shards ``shards()`` names with ``scrape`` and hands the lines due to ``send``."""

    def __init__(
        self,
        shards: Callable[[], Sequence[S]],
        scrape: Callable[[S], Coroutine[object, None, ReplicaLoad]],
        send: Callable[[tuple[ReplicaLoad, ...]], Awaitable[None]],
        pacing: Pacing,
        scrape_s: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.shards = shards
        self.scrape = scrape
        self.send = send
        self.pacer = LoadPacer(pacing)
        self.scrape_s = scrape_s
        # Most of a tick: what is not read by then is taken at a later tick.
        self.wait_s = scrape_s * 0.6
        self._clock = clock
        self._reading: dict[Key, asyncio.Task[ReplicaLoad]] = {}

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def tick(self, at: float) -> tuple[ReplicaLoad, ...]:
        """One tick at grid time ``at``: start the readings not under way, take those done, send the
        lines due. Returns what was sent."""
        shards = {sh.key: sh for sh in self.shards()}
        for k, t in list(self._reading.items()):
            if k not in shards:
                t.cancel()
        for k, sh in shards.items():
            if k not in self._reading:
                self._reading[k] = asyncio.create_task(self.scrape(sh), name=f"load-{k[0]}-{k[1]}")
        if self._reading:
            await asyncio.wait(self._reading.values(), timeout=self.wait_s)
        fresh = []
        for k, t in list(self._reading.items()):
            if not t.done():
                continue
            del self._reading[k]
            if t.cancelled():
                continue
            err = t.exception()
            if err is not None:
                # scrape() answers an unreachable engine with a blank line itself: this is a bug.
                log.error("reading the load of %s failed: %r", k, err)
                continue
            fresh.append(t.result())
        lines = self.pacer.take(fresh, at, shards)
        if lines:
            await self.send(lines)
        return lines

    async def run(self) -> None:
        """Tick on the grid until cancelled; the readings under way are cancelled with it."""
        start = self._now()
        k = 0
        try:
            while True:
                at = start + k * self.scrape_s
                await self.tick(at)
                # The next grid point still ahead (a slow tick skips the ones it overran).
                k = max(k + 1, math.floor((self._now() - start) / self.scrape_s) + 1)
                await asyncio.sleep(max(0.0, start + k * self.scrape_s - self._now()))
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        reading, self._reading = list(self._reading.values()), {}
        for t in reading:
            t.cancel()
        await asyncio.gather(*reading, return_exceptions=True)
