"""Following a KV bucket: a watch for speed plus a periodic full read for truth (:class:`KvFollower`).

Follows shared/design/NATS-NOTES.md: a periodic full resync behind every KV watch, because the watcher's
end-of-initial-values marker can arrive early.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable

import nats
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


class KvFollower:
    """Follows keys of a bucket: a watch for speed plus a periodic full read for truth.

    ``on_change(key, value_or_None, revision)`` is called for every key whose revision changed
    (``None`` when deleted). Values are raw bytes: decoding is the caller's, so the caller decides
    what a bad value means. A callback that raises is logged and counted (``errors``), and its value
    is not taken as seen: it is offered again every ``retry_s`` until the callback accepts it (or a
    newer value replaces it), while the watch goes on delivering other updates.
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
        # Key -> revision whose callback raised and is still to be retried; and every raise counted.
        self.failed: dict[str, int] = {}
        self.errors = 0
        # Keys that are not KV keys, each logged once.
        self.forged: set[str] = set()
        self._failure = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.synced = asyncio.Event()
        # False until a watch is established, and whenever it breaks (e.g. a role that may read one
        # key but not create a consumer): then the periodic read is all there is, so it runs often.
        self.watching = False

    async def start(self) -> None:
        await self.resync()
        self._tasks = [
            asyncio.create_task(self._watch(), name=f"{self.name}-watch"),
            asyncio.create_task(self._resync_loop(), name=f"{self.name}-resync"),
        ]

    async def stop(self) -> None:
        # Not one cancel: resync()'s kv.get can swallow it (see cancel_and_wait).
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
            if key not in self.revisions:
                self.failed.pop(key, None)  # never accepted, now gone: nothing left to retry
                return
        elif self.revisions.get(key, -1) >= rev:
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
        else:
            self.revisions[key] = rev

    async def resync(self) -> None:
        if self.key != ">" and not any(c in self.key for c in "*>"):
            # One concrete key: a direct get needs no consumer (and no permission to create one).
            keys = [self.key]
        else:
            keys = await kv_keys(self.kv)
        present = set()
        for k in keys:
            if not self._readable(k):
                continue
            try:
                e = await self.kv.get(k)
            except NotFoundError:  # absent or deleted
                continue
            present.add(k)
            await self._emit(k, e.value, e.revision or 0)
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
        self.synced.set()

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
                await self.resync()
            except (nats.errors.Error, TimeoutError) as e:
                log.debug("%s: resync failed: %s", self.name, e)

    async def _watch(self) -> None:
        while True:
            try:
                watcher = await self.kv.watch(self.key)
                self.watching = True
                async for e in watcher:
                    if e is None:
                        continue
                    deleted = e.operation in ("DEL", "PURGE")
                    await self._emit(e.key, None if deleted else e.value, e.revision or 0)
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, TimeoutError) as e:
                self.watching = False
                log.debug("%s: watch broke (%s); re-watching", self.name, e)
                await asyncio.sleep(1.0)
