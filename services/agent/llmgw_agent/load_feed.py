"""The engines' load on the bus, fresh (issue 34): read each ready engine every ``scrape_s``, send what
:mod:`llmgw_agent.load_pacing` lets through, in one :class:`~llmgw_common.messages.LoadReport` a tick.

No engine offers its running and waiting counts any better than its ``/metrics`` page (vLLM's KV events
carry blocks, not queues; llama-server has nothing to push), so the agent reads the page often. An
engine slow to answer holds only itself: a tick waits at most ``wait_s`` for the readings it started,
and a reading still under way is taken at a later tick (never two at once for one engine).

Ticks lie on a fixed grid of the loop's clock (a late tick skips the points it missed): the pacing
judges gaps on grid times, which makes ``min_gap_s`` a true bound on each replica's lines.

Between ticks, :meth:`LoadFeed.read_now` has one replica read at once, off the grid: the adapter pass
calls it when a load or unload ends (issue 33), as requests held for that adapter wait for its line. A
reading of it under way began before the change and is dropped; the pacing lets an adapter set change
through without the gap.
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
        # Replicas asked to be read at once (read_now), and the readings they dropped, until they end.
        self._asked: set[Key] = set()
        self._poke = asyncio.Event()
        self._dropped: set[asyncio.Task[ReplicaLoad]] = set()

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def read_now(self, key: Key) -> None:
        """Read replica ``key`` at once, off the grid (what it reports changed: its adapters). A reading
        of it under way started before the change: it is dropped, never sent."""
        t = self._reading.pop(key, None)
        if t is not None:
            t.cancel()
            self._dropped.add(t)
            t.add_done_callback(self._forget)
        self._asked.add(key)
        self._poke.set()

    def _forget(self, t: asyncio.Task[ReplicaLoad]) -> None:
        self._dropped.discard(t)
        if not t.cancelled():
            t.exception()  # retrieved: a dropped reading's outcome is of no use

    async def tick(self, at: float) -> tuple[ReplicaLoad, ...]:
        """One tick at grid time ``at``: start the readings not under way, take those done, send the
        lines due. Returns what was sent."""
        return await self._round(at, None)

    async def tick_asked(self, at: float) -> tuple[ReplicaLoad, ...]:
        """The replicas :meth:`read_now` asked for, read at ``at`` (off the grid); sends their lines due."""
        self._poke.clear()
        asked, self._asked = self._asked, set()
        return await self._round(at, asked)

    async def _round(self, at: float, only: set[Key] | None) -> tuple[ReplicaLoad, ...]:
        """Start the readings (of ``only``, or every shard) not under way, take those done, send."""
        shards = {sh.key: sh for sh in self.shards()}
        for k, t in list(self._reading.items()):
            if k not in shards:
                t.cancel()
        for k, sh in shards.items():
            if k not in self._reading and (only is None or k in only):
                self._reading[k] = asyncio.create_task(self.scrape(sh), name=f"load-{k[0]}-{k[1]}")
        mine = {k: t for k, t in self._reading.items() if only is None or k in only}
        if mine:
            await asyncio.wait(mine.values(), timeout=self.wait_s)
        fresh = []
        for k, t in list(mine.items()):
            if self._reading.get(k) is not t:
                continue  # dropped meanwhile (read_now): a newer reading follows
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
                await self._until(start + k * self.scrape_s)
        finally:
            await self.aclose()

    async def _until(self, at: float) -> None:
        """Wait for grid time ``at``, reading the replicas asked for meanwhile as they are asked."""
        while (left := at - self._now()) > 0:
            try:
                await asyncio.wait_for(self._poke.wait(), left)
            except TimeoutError:
                return
            await self.tick_asked(self._now())

    async def aclose(self) -> None:
        reading, self._reading = [*self._reading.values(), *self._dropped], {}
        for t in reading:
            t.cancel()
        await asyncio.gather(*reading, return_exceptions=True)
