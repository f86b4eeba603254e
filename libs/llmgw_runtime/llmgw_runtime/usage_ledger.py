"""Usage that lasts: per key, model and UTC hour, requests and tokens in and out, in KV ``llmgw_usage``.

Layout: one key per router incarnation and hour, ``<YYYYMMDDHH>.<router>.<since in ms>``, holding that
incarnation's *whole* totals for the hour (:class:`~llmgw_common.messages.UsageHour`). The router
rewrites it as the hour's counts grow (``update`` with the revision of its own last write).

Why a KV of whole totals and not a stream of increments de-duplicated by ``Nats-Msg-Id``:

- Counted exactly once by construction. A value replaces the one before; a write repeated after a lost
  ack, or a report sent twice, writes the same totals again and adds nothing. Increments with message
  ids are exact only inside the stream's de-duplication window (2 minutes by default): a router that
  resends after a longer NATS outage would count twice.
- One writer per key: the incarnation (router id and start time) is in the key, so a restarted router
  never touches its former self's totals, and those stay as they were when it died.
- The revision check (``update(last=rev)``) makes a second writer of the same key (two processes given
  one router id started in the same millisecond) fail loudly instead of overwriting.
- Reading is cheap: ``keys usage --since 30d`` reads one value per router incarnation and hour, not one
  message per request.

A router writes behind its answers, at most every 0.1 s under load (``llmgw_router.tenancy.ledger``),
so what a client was billed is in the ledger within that interval plus one write, unless the bus is
away (the router serves on, and writes when it is back) or the router is killed outright (the usage of
its last interval is lost with it; a router stopped writes everything first). The pure parts (keys, folding rows) are here for the CLI, the
console and the routers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

import nats.js.errors
from nats.js.kv import KeyValue

from llmgw_common.codec import DecodeError, decode
from llmgw_common.messages import UsageHour
from llmgw_runtime import bus

log = logging.getLogger(__name__)

HOUR = 3600.0
# Ledger values read at once by read_hours (a month is ~744 hours per router incarnation).
READ_CONCURRENCY = 32


def hour_start(now: float) -> float:
    return (now // HOUR) * HOUR


def hour_label(hour: float) -> str:
    """``2026120118``: the key's first token, sortable as text."""
    return time.strftime("%Y%m%d%H", time.gmtime(hour))


def ledger_key(hour: float, router: str, since: float) -> str:
    return f"{hour_label(hour)}.{router}.{round(since * 1000)}"


def key_hour(key: str) -> str:
    """The hour label of a ledger key (its first token)."""
    return key.partition(".")[0]


class By(StrEnum):
    MODEL = "model"
    DAY = "day"
    HOUR = "hour"


@dataclass(frozen=True, slots=True)
class UsageRow:
    key_id: str
    group: str  # the model, or the UTC day (YYYY-MM-DD), or the hour (YYYY-MM-DDTHH)
    requests: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def fold(hours: Iterable[UsageHour], by: By, since: float = 0.0, key_id: str | None = None) -> list[UsageRow]:
    """Rows summed per key and group, from ``since`` (hours that ended before it are left out; the
    hour holding it is counted whole: usage is kept per hour). Sorted by key id, then group."""
    sums: dict[tuple[str, str], list[int]] = {}
    for h in hours:
        if h.hour + HOUR <= since:
            continue
        for kid, per_model in h.usage.items():
            if key_id is not None and kid != key_id:
                continue
            for model, (reqs, prompt, completion) in per_model.items():
                if by is By.MODEL:
                    group = model
                elif by is By.DAY:
                    group = time.strftime("%Y-%m-%d", time.gmtime(h.hour))
                else:
                    group = time.strftime("%Y-%m-%dT%H", time.gmtime(h.hour))
                row = sums.setdefault((kid, group), [0, 0, 0])
                row[0] += reqs
                row[1] += prompt
                row[2] += completion
    return [UsageRow(k, g, r[0], r[1], r[2]) for (k, g), r in sorted(sums.items())]


def spent(
    hours: Iterable[UsageHour], day: float, month: float, skip: set[tuple[str, float]]
) -> dict[tuple[str, float], dict[str, dict[str, tuple[int, int]]]]:
    """(day, month) tokens per incarnation (router, since), key id and model, in the UTC day and month
    starting at ``day`` and ``month``, leaving out the incarnations in ``skip``: what a starting router
    takes as already spent of day and month budgets (quota.py)."""
    sums: dict[tuple[str, float], dict[str, dict[str, list[int]]]] = {}
    for h in hours:
        inc = (h.router, h.since)
        if h.hour < month or inc in skip:
            continue
        in_day = h.hour >= day
        per_key = sums.setdefault(inc, {})
        for kid, per_model in h.usage.items():
            per = per_key.setdefault(kid, {})
            for model, (_, prompt, completion) in per_model.items():
                row = per.setdefault(model, [0, 0])
                row[1] += prompt + completion
                if in_day:
                    row[0] += prompt + completion
    return {
        inc: {k: {m: (r[0], r[1]) for m, r in per.items()} for k, per in keys.items()}
        for inc, keys in sums.items()
    }


async def read_hours(kv: KeyValue, since: float = 0.0) -> list[UsageHour]:
    """Every ledger value from the hour holding ``since`` on (keys sort as their hours).

    The key listing is of headers only; the values wanted are then read ``READ_CONCURRENCY`` at a
    time, not one by one: a router's start waits for its month's ledger (its budgets) before serving.
    """
    first = hour_label(hour_start(since)) if since > 0 else ""
    keys = await bus.kv_keys(kv)
    wanted = sorted(k for k in keys if key_hour(k) >= first)
    gate = asyncio.Semaphore(READ_CONCURRENCY)

    async def one(k: str) -> UsageHour | None:
        async with gate:
            try:
                entry = await kv.get(k)
            except nats.js.errors.KeyNotFoundError:
                return None  # deleted meanwhile (an operator's purge)
        try:
            return decode(entry.value or b"", UsageHour)
        except DecodeError as e:
            log.warning("usage ledger %s does not decode, left out: %s", k, e)
            return None

    return [h for h in await asyncio.gather(*(one(k) for k in wanted)) if h is not None]
