"""The router's writer of durable usage (KV ``llmgw_usage``; the layout and why it counts exactly once:
``llmgw_runtime.usage_ledger``).

Group commit: an answer's usage is added to the table (usage.py), the writer is woken, and the request
waits (``settled``) until a write covering it is acknowledged before its last bytes go to the client.
Every request that finishes while a write is in flight joins the next one, so a busy router writes
about once per KV round trip, not once per request. While the bus is away nobody waits (serving goes
on); the hours changed stay marked and are written once it is back. A wait is bounded (``wait_s``):
a slow JetStream delays answers by at most that, never holds them.
"""

from __future__ import annotations

import asyncio
import contextlib
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

WAIT_S = 2.0
WRITE_TIMEOUT_S = 2.0
RETRY_S = 0.5


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
        wait_s: float = WAIT_S,
    ) -> None:
        self.table, self.kv, self.router, self.connected, self.clock = table, kv, router, connected, clock
        self.wait_s = wait_s
        self.written = 0  # the table version the last acknowledged write covered
        self.writes = 0
        self._wanted = asyncio.Event()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._revs: dict[str, int] = {}  # ledger key -> the revision of our last write of it
        # Set by the last flush that failed, cleared by one that succeeded (see the module's doc).
        self.failing = False
        table.ledger = self

    def kick(self) -> None:
        self._wanted.set()

    async def settled(self, version: int) -> None:
        if version <= self.written or self.failing or not self.connected():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = (version, fut)
        self._waiters.append(waiter)
        self._wanted.set()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.wait_s)
        except TimeoutError:
            pass
        finally:
            # A waiter given up on (timed out, cancelled) leaves the list: else it grows without bound.
            if not fut.done():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    async def run(self) -> None:
        """The writer loop (owned by the service: cancelled on stop, after a last ``flush``)."""
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            if not await self.flush():
                await asyncio.sleep(RETRY_S)
                self._wanted.set()

    async def flush(self) -> bool:
        """Write every hour changed since the last write, each on its own; False when one failed (it
        stays marked, the others are written)."""
        t = self.table
        version, dirty = t.version, t.dirty
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
                    "usage ledger writes failing (kept, written later; answers no longer wait): %s",
                    "; ".join(f"hour {h:.0f}: {e!r}" for h, e in failed),
                )
            self.failing = True
            # Nobody waits while writes fail (settled returns at once): release those who do now.
            self._release(None)
            return False
        if self.failing:
            log.info("usage ledger writes succeed again")
            self.failing = False
        self.written = version
        self.writes += 1
        self._forget_old()
        self._release(version)
        return True

    def _release(self, version: int | None) -> None:
        """Wake the waiters a write covered (all of them when ``version`` is None)."""
        keep = []
        for v, fut in self._waiters:
            if version is None or v <= version:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((v, fut))
        self._waiters = keep

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
