"""The router's writer of durable usage (KV ``llmgw_usage``; the layout and why it counts exactly once:
``llmgw_runtime.usage_ledger``).

Behind the answers, paced: an answer's usage is added to the table (usage.py) before its last bytes
go to the client, and the writer is woken; no answer waits for the write. The writer writes at once
when idle and at most once per ``interval_s`` (0.1 s) under load: everything added meanwhile goes in
the next write, so a busy router writes ten times a second, not once per request or per KV round trip.

What that costs is a bounded loss window, chosen by measurement (bench/ledger_wait.py, issue 36): a
router killed (SIGKILL, host lost) loses the usage of its last ``interval_s`` plus one write (108 ms
measured at 2,590 answers/s); one stopped (SIGTERM) drains, then flushes everything. Waiting for the
write (the group commit this replaced) added 1-11 ms at p50 and 12-62 ms at p99 to every answer, cost
a KV write per round trip per router, and was not exact either: a kill over-billed the answers whose
writes landed but whose bytes never reached their clients. While the bus is away the hours changed
stay marked and are written once it is back.

How far behind it is (``oldest_unwritten_s``, ``failing``; exported by ledgermetrics.py) is kept by the
writer per wake and per write, never per answer: the oldest unwritten usage is dated when the writer
first tries to write it or finds the bus away (at most ``interval_s`` after it was added, the writer
pacing itself: the age reads up to that much low), and usage added during a write that succeeded is
dated from that write's start (up to one write high).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.errors import Conflict
from llmgw_common.messages import UsageHour
from llmgw_router.tenancy.usage import UsageTable
from llmgw_runtime.usage_ledger import HOUR, ledger_key

log = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 2.0
RETRY_S = 0.5
# At most one write per this under load (the loss window on a kill; see the module's doc).
WRITE_INTERVAL_S = 0.1


class LedgerConflict(Conflict):
    """Another writer holds this incarnation's key (two processes with one router id and start)."""


class Ledger:
    def __init__(
        self,
        table: UsageTable,
        kv: KeyValue,
        router: str,
        connected: Callable[[], bool],
        clock: Callable[[], float],
        interval_s: float = WRITE_INTERVAL_S,
    ) -> None:
        self.table, self.kv, self.router, self.connected, self.clock = table, kv, router, connected, clock
        self.interval_s = interval_s
        self.written = 0  # the table version the last acknowledged write covered
        self.writes = 0
        self._wanted = asyncio.Event()
        self._revs: dict[str, int] = {}  # ledger key -> the revision of our last write of it
        # Set by the last flush that failed (or a wake that found the bus away), cleared by one that
        # succeeded (see the module's doc).
        self.failing = False
        self.failed = 0  # flushes that failed (a write refused or timed out)
        # When the oldest usage not yet written was first seen unwritten (None: all written).
        self.pending_since: float | None = None
        table.ledger = self

    def kick(self) -> None:
        self._wanted.set()

    async def run(self) -> None:
        """The writer loop (owned by the service: cancelled on stop, after a last ``flush``)."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            began = loop.time()
            # Nothing is tried while the bus is away (nats-py would buffer the write and time out):
            # the hours stay marked, and the next kick after it is back writes them.
            if not self.connected():
                if self.pending_since is None:
                    self.pending_since = self.clock()
                if not self.failing:
                    log.warning(
                        "usage ledger not written: the bus is away (kept in memory, written once back)"
                    )
                self.failing = True
                await asyncio.sleep(RETRY_S)
                self._wanted.set()
                continue
            if not await self.flush():
                await asyncio.sleep(RETRY_S)
                self._wanted.set()
                continue
            # Paced: what is added meanwhile waits for the next write, at most ``interval_s`` away.
            rest = self.interval_s - (loop.time() - began)
            if rest > 0:
                await asyncio.sleep(rest)

    async def flush(self) -> bool:
        """Write every hour changed since the last write, each on its own; False when one failed (it
        stays marked, the others are written)."""
        t = self.table
        began = self.clock()
        version, dirty = t.version, t.dirty
        if dirty and self.pending_since is None:
            self.pending_since = began
        t.dirty = set()
        failed: list[tuple[float, BaseException]] = []
        try:
            for hour in sorted(dirty):
                try:
                    await self._write(hour)
                except (nats.errors.Error, TimeoutError, LedgerConflict) as e:
                    failed.append((hour, e))
        except BaseException:
            # Cancelled mid-flush (the writer on stop): what this flush took stays marked for the next.
            t.dirty |= dirty
            raise
        if failed:
            t.dirty |= {h for h, _ in failed}
            if not self.failing:
                log.warning(
                    "usage ledger writes failing (kept in memory, written once they succeed): %s",
                    "; ".join(f"hour {h:.0f}: {e!r}" for h, e in failed),
                )
            self.failing = True
            self.failed += 1
            return False
        if self.failing:
            log.info("usage ledger writes succeed again")
            self.failing = False
        self.written = version
        self.writes += 1
        # Added while this write was under way: not in it, and no older than its start.
        self.pending_since = None if t.version == version else began
        self._forget_old()
        return True

    def oldest_unwritten_s(self) -> float:
        """How long the oldest usage not yet in the ledger has waited (0: everything is written)."""
        since = self.pending_since
        return 0.0 if since is None else max(0.0, self.clock() - since)

    async def _write(self, hour: float) -> None:
        t = self.table
        key = ledger_key(hour, self.router, t.since)
        rows = t.hours.get(hour, {})
        value = encode(
            UsageHour(
                router=self.router,
                since=t.since,
                hour=hour,
                written_at=self.clock(),
                usage={k: {m: (r[0], r[1], r[2]) for m, r in per.items()} for k, per in rows.items()},
            )
        )
        last = self._revs.get(key, 0)
        try:
            rev = await asyncio.wait_for(self.kv.update(key, value, last=last), WRITE_TIMEOUT_S)
        except nats.js.errors.KeyWrongLastSequenceError:
            # Most likely our own write whose ack was lost: take its revision if it is ours.
            rev = await self._adopt(key)
            rev = await asyncio.wait_for(self.kv.update(key, value, last=rev), WRITE_TIMEOUT_S)
        self._revs[key] = rev

    async def _adopt(self, key: str) -> int:
        try:
            entry = await asyncio.wait_for(self.kv.get(key), WRITE_TIMEOUT_S)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError) as e:
            # Deleted or purged (by an operator): write over the tombstone, or create it when nothing
            # of the key is left. What it held is gone; our table still has the hour's whole count.
            gone = e.entry
            return 0 if gone is None or gone.revision is None else gone.revision
        try:
            held = decode(entry.value or b"", UsageHour)
        except DecodeError as e:
            raise LedgerConflict(f"{key}: {e}") from None
        if held.router != self.router or held.since != self.table.since:
            raise LedgerConflict(f"{key} is written by {held.router}@{held.since}")
        if entry.revision is None:
            raise LedgerConflict(f"{key}: no revision")
        return entry.revision

    def _forget_old(self) -> None:
        """Hours written and over (an hour's grace for a late add) leave memory; the ledger has them."""
        t = self.table
        cutoff = self.clock() - 2 * HOUR
        for hour in [h for h in t.hours if h < cutoff and h not in t.dirty]:
            del t.hours[hour]
            self._revs.pop(ledger_key(hour, self.router, t.since), None)
