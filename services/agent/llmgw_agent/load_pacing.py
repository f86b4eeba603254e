"""When a replica's load goes on the bus (issue 34): pure, the clock passed in.

The agent reads every ready engine's load often (``load_scrape_s``) and sends a replica's line when it
changed, at most every ``min_gap_s`` per replica (a busy engine's figures change at every scrape: this
bounds the bus to a few lines a second per replica), and at least every ``max_gap_s`` (the heartbeat
interval) unchanged, so a reader judges a line's freshness by its own clock as before and a replica
whose agent died goes stale. A load report then carries only the lines due, not the node's whole list:
readers (routers, the control plane) already keep the newest line per replica.

Times are the load loop's tick times on a fixed grid (:class:`LoadPacer` is fed them), so a change seen
one tick after a send goes out ``min_gap_s`` after it, never sooner, whatever the loop's jitter.

One change skips the gap: the replica's adapter set (LoRA adapters loaded, and why a load failed; issue
33). Requests held for an adapter wait for the line that says it is loaded (or failed), and such a change
is rare (each is a load or unload through the engine's API), so the bus stays bounded. Which adapters are
busy is not part of it: that follows the requests, as running and waiting do.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmgw_common.messages import ReplicaLoad

Key = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Pacing:
    # At most one line per replica this often, however often its load changes.
    min_gap_s: float = 0.25
    # At least one line per replica this often, unchanged (the heartbeat interval).
    max_gap_s: float = 2.0


@dataclass(frozen=True, slots=True)
class Sent:
    load: ReplicaLoad
    at: float


def due(load: ReplicaLoad, last: Sent | None, now: float, pacing: Pacing) -> bool:
    """Whether ``load`` (a fresh reading) goes out at ``now``, given the replica's last line sent."""
    if last is None:
        return True
    gap = now - last.at
    if gap >= pacing.max_gap_s:
        return True
    if adapter_set(load) != adapter_set(last.load):
        return True
    # Any field counts: running, waiting, KV use, the prefix counters, the busy adapters.
    return gap >= pacing.min_gap_s and load != last.load


def adapter_set(load: ReplicaLoad) -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    """The adapters a line says are loaded, and their load errors, in no order (the engine's list may
    come back in another)."""
    return frozenset(load.adapters), frozenset(load.adapter_errors.items())


def key_of(load: ReplicaLoad) -> Key:
    return (load.replica_id, load.shard)


class LoadPacer:
    """The line last sent per replica, and which of a tick's fresh readings go out now."""

    def __init__(self, pacing: Pacing) -> None:
        self.pacing = pacing
        self._sent: dict[Key, Sent] = {}

    def take(
        self, fresh: Iterable[ReplicaLoad], now: float, running: Iterable[Key]
    ) -> tuple[ReplicaLoad, ...]:
        """The readings of ``fresh`` due at ``now``, recorded as sent. ``running``: the replicas read
        now; any other is forgotten, so that one back again (restarted, re-adopted) is sent at once."""
        keep = set(running)
        for k in [k for k in self._sent if k not in keep]:
            del self._sent[k]
        out = []
        for load in fresh:
            k = key_of(load)
            if k in keep and due(load, self._sent.get(k), now, self.pacing):
                self._sent[k] = Sent(load, now)
                out.append(load)
        return tuple(out)
