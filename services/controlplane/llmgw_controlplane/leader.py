"""The leader lease: one key in ``<prefix>_leader``, taken with create(), renewed with update(last=rev).

The key's revision only grows, so it is the fencing token carried by every assignment. Expiry is
judged two ways, both safe: the bucket's TTL removes a key nobody renews, and a standby that has seen
the same revision for a whole TTL by its *own* clock takes it over with a compare-and-set on that
revision (which fails if the holder renewed meanwhile). The holder counts itself leader only while its
last successful renewal is younger than the TTL minus a margin, so it stops acting before a standby
could have taken over, even if it cannot reach NATS to find out.

A holder must never lose a compare-and-set to itself: the lease loop's renewal and a pass's confirm()
take turns under one lock (two in flight on one revision: the second failed, and the leader stepped
down for a TTL), and a renewal that landed unseen (its reply timed out, its task was cancelled) is
recognised by this tenure's own record and renewed from, not taken for another holder's. Long work
between renewals (a takeover's load) runs under while_renewing(), so the key cannot lapse under it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from llmgw_common.codec import encode
from llmgw_common.ctl import LeaseRecord
from llmgw_common.subjects import LEADER_KEY
from llmgw_runtime import bus
from llmgw_runtime.runtime import cancel_and_wait

log = logging.getLogger("llmgw.controlplane.leader")
# JetStream's "wrong last sequence" error codes (the ones nats-py maps to KeyWrongLastSequenceError).
WRONG_LAST_CODES = (10071, 10164)

T = TypeVar("T")


class LeaseLost(Exception):
    """The lease went while work that needed it was under way."""


class NotOurs(Exception):
    """The lease key moved, and not by a renewal of ours: says what holds it (or that it lapsed)."""


class Lease:
    def __init__(
        self,
        kv: KeyValue,
        holder: str,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.kv = kv
        self.holder = holder
        self.ttl_s = ttl_s
        self.clock = clock
        self.wall = wall
        self.revision = 0
        self._renewed_at: float | None = None
        self._acquired_at = 0.0
        # What a standby last saw of someone else's lease, and since when (own clock).
        self._seen_rev = 0
        self._seen_at = 0.0
        # Every read-modify-write of the key (renew, take, release) runs alone: see the module docstring.
        self._lock = asyncio.Lock()
        # Own clock: since when no call to the lease bucket was answered (None: the last one was). A
        # refusal is an answer; only errors and timeouts count (the server we are on cannot reach the
        # bucket: see Leadership.leave_if_stranded).
        self.failing_since: float | None = None

    def _answered(self) -> None:
        self.failing_since = None

    def _unanswered(self, t0: float) -> None:
        if self.failing_since is None:
            self.failing_since = t0

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    def held(self) -> bool:
        """Leader now: renewed recently enough that no standby can have taken over yet."""
        return self._renewed_at is not None and self.clock() - self._renewed_at < self.ttl_s * 0.8

    def unrenewed_s(self) -> float | None:
        """Seconds since the last renewal (None: not held at all): why ``held()`` turned false."""
        return None if self._renewed_at is None else self.clock() - self._renewed_at

    @property
    def fence(self) -> int:
        return self.revision

    def _value(self) -> bytes:
        now = self.wall()
        return encode(LeaseRecord(holder=self.holder, acquired_at=self._acquired_at or now, renewed_at=now))

    def _lose(self, why: str) -> None:
        if self._renewed_at is not None:
            log.warning("leadership lost (%s)", why)
        self._renewed_at = None

    async def step(self) -> bool:
        """Renew when held, else try to take; returns whether this process is leader afterwards."""
        async with self._lock:
            return await self._step()

    async def _step(self) -> bool:
        t0 = self.clock()
        if self._renewed_at is not None:
            try:
                await self._renew()
                self._renewed_at = t0
                self._answered()
            except NotOurs as e:
                self._lose(str(e))
            except KeyWrongLastSequenceError:
                self._answered()
                self._lose("another control plane holds the lease")
            except (nats.errors.Error, TimeoutError) as e:
                self._unanswered(t0)
                if not self.held():
                    self._lose(f"could not renew: {e}")
            return self.held()
        return await self._try_take(t0)

    async def _renew(self) -> None:
        try:
            self.revision = await self.kv.update(LEADER_KEY, self._value(), last=self.revision)
        except KeyWrongLastSequenceError:
            own = await self._own_revision()
            log.info("lease revision %d is our own unseen renewal: renewing from it", own)
            self.revision = await self.kv.update(LEADER_KEY, self._value(), last=own)

    async def _own_revision(self) -> int:
        """The key's revision when its record is this tenure's own (holder and acquired_at), else NotOurs.

        The holder name alone is not enough: hostname-pid repeats across container restarts. Any doubt
        (unreadable, unreachable) is NotOurs too: the lease is then treated as someone else's.
        """
        try:
            rec, rev = await bus.kv_get(self.kv, LEADER_KEY, LeaseRecord)
        except (nats.errors.Error, TimeoutError) as e:
            raise NotOurs(f"the lease moved and could not be read: {e}") from None
        if rec is not None and rec.holder == self.holder and rec.acquired_at == self._acquired_at:
            return rev
        if rev == 0:
            # A lone control plane starved for a TTL (a takeover's load, a stalled loop) sees this, not a rival.
            since = (
                ""
                if self._renewed_at is None
                else f", not renewed for {self.clock() - self._renewed_at:.1f}s"
            )
            raise NotOurs(f"the lease lapsed (TTL {self.ttl_s:g}s{since})")
        raise NotOurs(f"{rec.holder if rec else 'another control plane'} holds the lease")

    async def _try_take(self, t0: float) -> bool:
        try:
            self._acquired_at = self.wall()
            self.revision = await self.kv.create(LEADER_KEY, self._value())
            self._renewed_at = t0
            self._answered()
            log.info("leadership taken (fence %d)", self.revision)
            return True
        except KeyWrongLastSequenceError:
            self._answered()
        except (nats.errors.Error, TimeoutError) as e:
            log.debug("lease create failed: %s", e)
            self._unanswered(t0)
            return False
        try:
            entry = await self.kv.get(LEADER_KEY)
        except KeyNotFoundError:
            return False  # lapsed between the two calls: the next step creates it
        except (nats.errors.Error, TimeoutError):
            self._unanswered(t0)
            return False
        rev = entry.revision or 0
        if rev != self._seen_rev:
            self._seen_rev, self._seen_at = rev, t0
            return False
        if t0 - self._seen_at < self.ttl_s:
            return False
        # Nobody renewed for a whole TTL by our clock: take it, unless it changes under us.
        try:
            self._acquired_at = self.wall()
            self.revision = await self.kv.update(LEADER_KEY, self._value(), last=rev)
        except KeyWrongLastSequenceError:
            return False
        except (nats.errors.Error, TimeoutError):
            return False
        self._renewed_at = t0
        log.info("leadership taken over from a silent holder (fence %d)", self.revision)
        return True

    async def confirm(self) -> bool:
        """Renew now: proof of holding the lease right before a write (the fence check)."""
        async with self._lock:
            if self._renewed_at is None:
                return False
            return await self._step()

    async def while_renewing(self, aw: Awaitable[T]) -> T:
        """``aw``'s result, renewing every ``renew_every_s`` meanwhile, as the lease loop would have.

        For a takeover's load, which at thousands of nodes can outlast the TTL: renewing only after it,
        the holder found its key lapsed, stepped down and took over (and loaded) again, in a loop.
        Raises LeaseLost, with ``aw`` cancelled, if a renewal fails.
        """
        task = asyncio.ensure_future(aw)
        try:
            while True:
                await asyncio.wait({task}, timeout=self.renew_every_s)
                if task.done():
                    return task.result()
                if not await self.step():
                    raise LeaseLost("the lease was lost while taking over")
        finally:
            if not task.done():
                # Not one cancel: the load's KV reads can swallow it (see cancel_and_wait), and a load
                # that goes on acts as leader after the lease was lost.
                await cancel_and_wait([task])

    async def release(self) -> None:
        """Give the lease up on a clean shutdown so a standby takes over at once."""
        async with self._lock:
            if self._renewed_at is None:
                return
            self._renewed_at = None
            try:
                try:
                    await self.kv.delete(LEADER_KEY, last=self.revision)
                except nats.js.errors.APIError as e:
                    if not _wrong_last(e):
                        raise
                    # Ours at a revision we never learnt: delete that. A successor's: NotOurs, left alone.
                    await self.kv.delete(LEADER_KEY, last=await self._own_revision())
            except NotOurs as e:
                log.debug("lease not released: %s", e)
            except (nats.errors.Error, TimeoutError) as e:
                log.debug("lease release failed: %s", e)


def _wrong_last(e: nats.js.errors.APIError) -> bool:
    """A compare-and-set refused: update() raises its own type, delete() a bare API error (nats-py)."""
    return isinstance(e, KeyWrongLastSequenceError) or e.err_code in WRONG_LAST_CODES
