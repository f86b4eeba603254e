"""Multi-node simulation: a leader (rank 0) is whole only while its W-1 followers keep beating.

Followers POST ``{"rank", "world", "instance"}`` to the leader's ``/_sim/join`` until it answers 200,
then keep posting it every ``heartbeat_s`` as a heartbeat. The leader forgets a follower silent for
``HEARTBEAT_MISSES`` beats, and is then unhealthy, as a real multi-node engine is when a worker dies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

HEARTBEAT_MISSES = 4
JOIN_PATH = "/_sim/join"


@dataclass(slots=True)
class _Member:
    instance: str
    last_seen: float


class Membership:
    """The leader's view of its followers. Time comes from ``clock`` so that tests need no sleep."""

    def __init__(self, world: int, heartbeat_s: float, clock: Callable[[], float]) -> None:
        self.world = world
        self.timeout_s = heartbeat_s * HEARTBEAT_MISSES
        self._clock = clock
        self._members: dict[int, _Member] = {}

    def join(self, body: Any) -> str | None:
        """Record a join or heartbeat; returns why it was refused, or None when accepted."""
        if not isinstance(body, dict):
            return "join body must be an object with rank, world and instance"
        rank, world, instance = body.get("rank"), body.get("world"), body.get("instance")
        if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(instance, str):
            return "join body must carry an integer rank and a string instance"
        if world != self.world:
            return f"follower says world {world}, the leader has world {self.world}"
        if not 1 <= rank < self.world:
            return f"rank {rank} is not a follower rank of world {self.world} (1..{self.world - 1})"
        member = self._members.get(rank)
        if member is not None and member.instance != instance:
            log.info("rank %d rejoined as a new instance %s (was %s)", rank, instance, member.instance)
        elif member is None:
            log.info("rank %d joined (instance %s)", rank, instance)
        self._members[rank] = _Member(instance, self._clock())
        return None

    def missing(self) -> list[int]:
        """Follower ranks that never joined or went silent."""
        now = self._clock()
        return [
            r
            for r in range(1, self.world)
            if (m := self._members.get(r)) is None or now - m.last_seen > self.timeout_s
        ]


async def follow(
    leader: str,
    rank: int,
    world: int,
    instance: str,
    heartbeat_s: float,
    on_change: Callable[[bool], None],
    stop: asyncio.Event,
) -> None:
    """Join ``leader`` and keep beating until ``stop``; report joined/lost through ``on_change``."""
    url = f"http://{leader}{JOIN_PATH}"
    body = {"rank": rank, "world": world, "instance": instance}
    joined = False
    refused_with: str | None = None
    timeout = aiohttp.ClientTimeout(total=max(heartbeat_s * 2, 1.0))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            ok = False
            try:
                async with session.post(url, json=body) as resp:
                    text = await resp.text()
                    ok = resp.status == 200
                    if not ok and text != refused_with:
                        refused_with = text
                        log.warning("leader %s refused rank %d: %s %s", leader, rank, resp.status, text)
            except (aiohttp.ClientError, TimeoutError) as e:
                if joined:
                    log.warning("lost the leader %s: %s", leader, e)
            if ok != joined:
                joined = ok
                if ok:
                    refused_with = None
                    log.info("rank %d joined leader %s", rank, leader)
                on_change(joined)
            try:
                await asyncio.wait_for(stop.wait(), heartbeat_s)
            except TimeoutError:
                pass
