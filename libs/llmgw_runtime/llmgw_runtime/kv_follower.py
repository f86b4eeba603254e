"""Following a KV bucket: a watch for speed, and a resync that reads only what changed (:class:`KvFollower`).

A KV value's revision is its stream sequence, and a stream's messages are numbered in the order they
were written, so a follower that has seen every message up to sequence ``seq`` knows the bucket as of
``seq``. The watch (an ordered consumer, which nats-py restarts from its own last sequence on a gap)
keeps ``seq`` moving; the periodic check asks the stream its last sequence (one small request, whatever
the bucket holds) and, when the watch is behind it and does not move for a moment, reads the messages
after ``seq`` one by one (only what changed) and starts a new watch from there. The whole bucket is read
only when its stream was made anew (its creation time changed, or its sequence went back).

shared/design/NATS-NOTES.md says why a watch alone is not trusted: its end-of-initial-values marker can
come early (nats.py #842), and after a server restart a watcher recovers only when its heartbeat lapses.
Both leave ``seq`` behind the stream's last sequence, which the check sees.

A follower of one concrete key (an agent's assignment) reads that key directly at each check: the cost
is one value whatever the bucket holds, and the role needs no permission beyond that key.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import re
from collections.abc import Awaitable, Callable, Mapping

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from llmgw_common.names import visible
from llmgw_runtime.bus import kv_keys
from llmgw_runtime.runtime import cancel_and_wait

# The bus's logger, as before this class had its own module (the CLI quietens it by this name).
log = logging.getLogger("llmgw.bus")

# How often a follower re-reads while it has no working watch, or a value its callback refused.
UNWATCHED_RESYNC_S = 2.0

# The keys nats.py reads and writes (its VALID_KEY_RE). The server stores and lists others too, made by
# a raw publish on $KV.<bucket>.<key>, but nats.py refuses to get them (InvalidKeyError): only a forger
# makes one, and a follower must pass over it, not stop its full read there (a service could not start).
_KV_KEY = re.compile(r"[-/_=.a-zA-Z0-9]+")

# Headers that make a KV message a removal: nats.py's KV-Operation, and nats-server 2.11+'s markers.
_KV_OP = "KV-Operation"
_MARKER = "Nats-Marker-Reason"

# At start, the watch's replay is waited for while it makes progress; this long without any, the rest
# is read message by message.
_REPLAY_STALL_S = 1.0

# A check that finds the stream ahead of the watch waits this long for the watch to move before it
# reads the rest itself: the worst delay of a change the watch lost is resync_s plus this.
WATCH_GRACE_S = 0.25

# An idle watch consumer (no subscriber: a client gone) is removed by the server after this long.
_WATCH_INACTIVE_S = 60.0


def _removal(headers: Mapping[str, str] | None) -> bool:
    if not headers:
        return False
    op = headers.get(_KV_OP)
    if op is not None:
        return op in ("DEL", "PURGE")
    return headers.get(_MARKER) in ("MaxAge", "Purge", "Remove")


class KvFollower:
    """Follows keys of a bucket: a watch, plus a periodic check that reads only what the watch missed.

    ``on_change(key, value_or_None, revision)`` is called for every key whose revision changed
    (``None`` when deleted). Values are raw bytes: decoding is the caller's, so the caller decides
    what a bad value means. A callback that raises is logged and counted (``errors``), and its value
    is not taken as seen: it is offered again every ``retry_s`` until the callback accepts it (or a
    newer value replaces it), while the watch goes on delivering other updates.

    ``reads`` counts the messages read outside the watch (by a check's catch-up or a full read) and
    ``full_reads`` the full reads: what a check cost beyond its one request.
    """

    def __init__(
        self,
        kv: KeyValue,
        on_change: Callable[[str, bytes | None, int], Awaitable[None] | None],
        *,
        key: str = ">",
        resync_s: float = 10.0,
        retry_s: float = UNWATCHED_RESYNC_S,
        name: str = "kv",
    ) -> None:
        self.kv = kv
        self.on_change = on_change
        self.key = key
        self.resync_s = resync_s
        self.retry_s = retry_s
        self.name = name
        # Revisions the callback accepted; a refused one is absent, so the next read offers it again.
        self.revisions: dict[str, int] = {}
        # Key -> revision of its delete marker, so a stale put read after it (a catch-up racing the
        # watch) is not taken for news. Emptied by a full read.
        self.removed: dict[str, int] = {}
        # Key -> revision whose callback raised and is still to be retried; and every raise counted.
        self.failed: dict[str, int] = {}
        self.errors = 0
        # Keys that are not KV keys, each logged once.
        self.forged: set[str] = set()
        # Every message of the bucket up to this stream sequence has been seen (watched or read).
        self.seq = 0
        self.reads = 0
        self.full_reads = 0
        # The stream's creation time when last looked at: another one means the bucket was made anew.
        self._created: datetime.datetime | None = None
        self._failure = asyncio.Event()
        self._rewatch = asyncio.Event()
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.synced = asyncio.Event()
        # False until a watch is established, and whenever it breaks (e.g. a role that may read one
        # key but not create a consumer): then the periodic check is all there is, so it runs often.
        self.watching = False
        self._one_key = key != ">" and not any(c in key for c in "*>")

    async def start(self) -> None:
        if self._one_key:
            await self.resync()
            self._tasks = [asyncio.create_task(self._watch(), name=f"{self.name}-watch")]
        else:
            last, self._created = await self._stream_state()
            self._tasks = [asyncio.create_task(self._watch(), name=f"{self.name}-watch")]
            await self._await_replay(last)
            # What the replay did not bring (its end marker early, the watch refused): read one by one.
            await self._catch_up(last)
        self._tasks.append(asyncio.create_task(self._resync_loop(), name=f"{self.name}-resync"))
        self.synced.set()

    async def stop(self) -> None:
        # Not one cancel: a kv.get can swallow it (see cancel_and_wait).
        await cancel_and_wait(self._tasks)
        self._tasks = []

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The watch and resync loops: a service treats either ending as its own death."""
        return list(self._tasks)

    def _readable(self, key: str) -> bool:
        if _KV_KEY.fullmatch(key):
            return True
        if key not in self.forged:
            self.forged.add(key)
            log.warning(
                "%s: ignoring key %s: not a KV key (made by a raw publish?)", self.name, visible(repr(key))
            )
        return False

    async def _emit(self, key: str, value: bytes | None, rev: int) -> None:
        if not self._readable(key):
            return
        if value is None:
            if rev and self.removed.get(key, -1) >= rev:
                return
            if key not in self.revisions:
                if rev:
                    self.removed[key] = rev
                self.failed.pop(key, None)  # never accepted, now gone: nothing left to retry
                return
            if rev and self.revisions[key] > rev:
                return  # a put newer than this delete was taken already
        elif self.revisions.get(key, -1) >= rev or self.removed.get(key, -1) > rev:
            return
        try:
            r = self.on_change(key, value, rev)
            if r is not None:
                await r
        except Exception as e:  # the caller's to fix; the follow (and every other key) must go on
            self.errors += 1
            again = self.failed.get(key) == rev
            self.failed[key] = rev
            self._failure.set()
            log.error(
                "%s: callback for %s (revision %d) failed%s (%d error(s) so far); retrying in %gs: %s",
                self.name, key, rev, " again" if again else "", self.errors, self.retry_s, e,
                exc_info=not again,  # one traceback per value, not one per retry
            )  # fmt: skip
            return
        self.failed.pop(key, None)
        if value is None:
            self.revisions.pop(key, None)
            if rev:
                self.removed[key] = rev
        else:
            self.revisions[key] = rev
            self.removed.pop(key, None)

    # ------------------------------------------------------------ reads

    async def _stream_state(self) -> tuple[int, datetime.datetime | None]:
        """The stream's last sequence and creation time: one request, its answer the same size whatever
        the bucket holds."""
        info = await self.kv._js.stream_info(self.kv._stream)
        return info.state.last_seq, info.created

    async def resync(self) -> None:
        """A full read: every key listed and read. At start for one key, and when the stream was made anew."""
        if self._one_key:
            # One concrete key: a direct get needs no consumer (and no permission to create one).
            keys = [self.key]
        else:
            self.full_reads += 1
            last, self._created = await self._stream_state()
            keys = await kv_keys(self.kv)
            self.removed.clear()
        present = set()
        for k in keys:
            if not self._readable(k):
                continue
            try:
                e = await self.kv.get(k)
            except NotFoundError:  # absent or deleted
                continue
            self.reads += 1
            present.add(k)
            await self._emit(k, e.value, e.revision or 0)
            self.seq = max(self.seq, e.revision or 0)
        for k in list(self.revisions):
            if k in present:
                continue
            # A listing can come back short (its end marker early, nats.py #842; seen as an empty
            # listing just after a cluster peer died): only a direct read says a key is gone.
            try:
                e = await self.kv.get(k)
            except NotFoundError:  # absent or deleted
                await self._emit(k, None, 0)
                continue
            await self._emit(k, e.value, e.revision or 0)
        for k in list(self.failed):
            if k not in present and k not in self.revisions:
                del self.failed[k]  # refused, then deleted before it was accepted
        if not self._one_key:
            # Listed after the sequence was read: everything up to it is known.
            self.seq = max(self.seq, last)
        self.synced.set()

    async def check(self) -> None:
        """The periodic resync: read what the watch has not delivered, and nothing else."""
        if self._one_key:
            await self.resync()
            return
        # The sequence seen before asking: the watch may deliver past the answer while it comes back.
        seen = self.seq
        last, created = await self._stream_state()
        if created != self._created or last < seen:
            # The bucket was deleted and made again: its sequence numbers say nothing of ours.
            log.info("%s: the bucket's stream was made anew; reading it whole", self.name)
            # Its revisions start over: those held say nothing of the new values (each key still held,
            # so one the new bucket lacks is seen gone), nor does the sequence.
            self.revisions = dict.fromkeys(self.revisions, 0)
            self.removed.clear()
            self.seq = 0
            await self.resync()
            self._rewatch.set()
            return
        if last <= self.seq:
            return
        if self.watching:
            # Usually the watch is delivering it right now: give it a moment, and leave it be while it
            # moves (a burst of changes takes a while), so nothing is read twice.
            before = self.seq
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), WATCH_GRACE_S)
            if self.seq >= last or self.seq > before:
                return
        read = self.reads
        await self._catch_up(last)
        if self.watching and self.reads > read:
            # (Nothing read: the messages were for keys outside a wildcard filter, or are gone.)
            log.info("%s: the watch missed changes; watching anew from sequence %d", self.name, self.seq)
            self._rewatch.set()

    async def _catch_up(self, last: int) -> None:
        """Read every message after ``seq`` up to ``last``, one request each, from the stream's leader
        (a replica still catching up could answer "none" for one the leader holds)."""
        js, stream, pre = self.kv._js, self.kv._stream, self.kv._pre
        subject = f"{pre}{self.key}"
        n = self.seq + 1
        while n <= last:
            try:
                m = await js.get_msg(stream, seq=n, subject=subject, next=True)
            except NotFoundError:
                break
            self.reads += 1
            value = None if _removal(m.headers) else (m.data or b"")
            await self._emit((m.subject or "")[len(pre) :], value, m.seq or n)
            self.seq = max(self.seq, m.seq or n)
            # Past what the watch delivered meanwhile too: a watch that moves again is not read twice.
            n = max(m.seq or n, self.seq) + 1
        # Every message up to ``last`` still in the stream was read (one that is gone was replaced by a
        # later one, read here or to come).
        self.seq = max(self.seq, last)

    async def _retry_failed(self) -> None:
        for k in list(self.failed):
            try:
                e = await self.kv.get(k)
            except NotFoundError:
                await self._emit(k, None, 0)
                continue
            self.reads += 1
            await self._emit(k, e.value, e.revision or 0)

    async def _resync_loop(self) -> None:
        while True:
            if self.watching and not self.failed:
                # A refused value wakes this loop: it is retried after retry_s, not after resync_s.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._failure.wait(), self.resync_s)
            if self.failed or not self.watching:
                await asyncio.sleep(min(self.resync_s, self.retry_s))
            self._failure.clear()
            try:
                if self.failed and not self._one_key:
                    await self._retry_failed()
                await self.check()
            except (nats.errors.Error, TimeoutError) as e:
                log.debug("%s: resync failed: %s", self.name, e)

    # ------------------------------------------------------------ the watch

    async def _await_replay(self, last: int) -> None:
        """Until the watch has delivered up to ``last``, or made no progress for a while."""
        while self.seq < last:
            before = self.seq
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), _REPLAY_STALL_S)
            if self.seq == before and not self._progress.is_set():
                return

    async def _on_msg(self, msg: Msg) -> None:
        rev = msg.metadata.sequence.stream
        value = None if _removal(msg.headers) else msg.data
        await self._emit(msg.subject[len(self.kv._pre) :], value, rev)
        if rev > self.seq:
            self.seq = rev
        self._progress.set()

    async def _subscribe(self) -> Subscription:
        if self.seq == 0:
            # The current value of every key, then what follows.
            config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        else:
            # Resumed after what was seen: nothing is read twice.
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.seq + 1
            )
        config.inactive_threshold = _WATCH_INACTIVE_S
        return await self.kv._js.subscribe(
            f"{self.kv._pre}{self.key}", stream=self.kv._stream, cb=self._on_msg, ordered_consumer=True,
            config=config,
        )  # fmt: skip

    async def _watch(self) -> None:
        while True:
            try:
                sub = await self._subscribe()
            except (nats.errors.Error, TimeoutError) as e:
                self.watching = False
                log.debug("%s: watch failed (%s); watching again in 1s", self.name, e)
                await asyncio.sleep(1.0)
                continue
            self.watching = True
            self._rewatch.clear()
            try:
                await self._rewatch.wait()
            finally:
                self.watching = False
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await sub.unsubscribe()
