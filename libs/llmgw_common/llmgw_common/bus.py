"""Bus helpers: connect with reconnects, ensure buckets and streams, typed subscriptions, KV followers.

Everything here follows shared/design/NATS-NOTES.md: a short ping interval, endless reconnects,
bind-before-create for buckets, callbacks rather than ``sub.messages``, and a periodic full resync
behind every KV watch because the watcher's end-of-initial-values marker can arrive early.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel

from llmgw_common.codec import DecodeError, decode
from llmgw_common.names import visible
from llmgw_common.runtime import cancel_and_wait
from llmgw_common.settings import BusSettings
from llmgw_common.subjects import Subjects

log = logging.getLogger("llmgw.bus")
M = TypeVar("M", bound=BaseModel)


def _tls_context(s: BusSettings) -> ssl.SSLContext | None:
    if not (s.nats_tls_ca or s.nats_tls_cert):
        return None
    ctx = ssl.create_default_context(cafile=s.nats_tls_ca)
    if s.nats_tls_cert:
        ctx.load_cert_chain(s.nats_tls_cert, s.nats_tls_key)
    return ctx


async def connect(
    s: BusSettings,
    name: str,
    *,
    connect_timeout: float = 5.0,
    wait: bool = True,
    on_disconnect: Callable[[], None] | None = None,
    on_reconnect: Callable[[], None] | None = None,
) -> NATS:
    """A NATS client that reconnects forever and notices a dead server within seconds.

    With ``wait`` (the default for services) the first connection is retried until it succeeds, so a
    service started before NATS waits for it instead of exiting; the CLI passes ``wait=False``.
    """

    async def error_cb(e: Exception) -> None:
        log.warning("nats (%s): %s", name, e)

    async def disconnected_cb() -> None:
        # A short-lived client (the CLI) disconnects on every close: not news.
        log.log(logging.WARNING if wait else logging.DEBUG, "nats (%s): disconnected", name)
        if on_disconnect is not None:
            on_disconnect()

    async def reconnected_cb() -> None:
        log.info("nats (%s): reconnected", name)
        if on_reconnect is not None:
            on_reconnect()

    opts: dict[str, Any] = dict(
        servers=s.nats_urls,
        name=name,
        ping_interval=2,
        max_outstanding_pings=3,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=connect_timeout,
        allow_reconnect=True,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
    )
    if s.nats_user:
        opts["user"], opts["password"] = s.nats_user, s.nats_password
    if s.nats_token:
        opts["token"] = s.nats_token
    if s.nats_creds:
        opts["user_credentials"] = s.nats_creds
    if s.nats_inbox_prefix:
        opts["inbox_prefix"] = s.nats_inbox_prefix
    tls = _tls_context(s)
    if tls is not None:
        opts["tls"] = tls
    if not wait:
        # A client (the CLI) wants a prompt answer when nothing is there, not endless retries.
        opts["allow_reconnect"] = False
        opts["max_reconnect_attempts"] = 1  # 0 would mean "forever" inside nats.connect
    # With reconnects allowed, nats.connect itself retries the first connection forever.
    return await nats.connect(**opts)


async def connect_unless_stopped(
    s: BusSettings,
    name: str,
    stop: asyncio.Event,
    **kw: Any,
) -> NATS | None:
    """:func:`connect` for a service, or None when ``stop`` is set first.

    With NATS unreachable the first connection is retried forever, and a SIGTERM only sets ``stop``:
    without this race a service asked to stop before NATS answered kept retrying, deaf to it.
    """
    connecting = asyncio.create_task(connect(s, name, **kw), name=f"{name}-connect")
    stopping = asyncio.create_task(stop.wait(), name=f"{name}-stop-early")
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    await asyncio.gather(stopping, return_exceptions=True)
    if connecting.done():
        return connecting.result()
    # nats-py can swallow one cancellation inside its retry loop: cancel until it is over.
    while not connecting.done():
        connecting.cancel()
        await asyncio.wait({connecting}, timeout=0.5)
    if not connecting.cancelled() and connecting.exception() is None:
        await connecting.result().close()
    log.info("nats (%s): stopped before NATS answered", name)
    return None


async def ensure_kv(
    js: JetStreamContext,
    bucket: str,
    *,
    history: int = 1,
    ttl: float | None = None,
    replicas: int = 1,
) -> KeyValue:
    """Bind to a bucket, creating it only when it does not exist (a config mismatch would fail)."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    # direct=True: reads of one key go to $JS.API.DIRECT.GET.<stream>.<key subject>, a subject that
    # per-role permissions can grant key by key (an agent reads only its own assignment).
    cfg = KeyValueConfig(bucket=bucket, history=history, ttl=ttl, replicas=replicas, direct=True)
    try:
        return await js.create_key_value(config=cfg)
    except nats.js.errors.BadRequestError:
        # Someone else created it between our bind and create.
        return await js.key_value(bucket)


async def ensure_stream(
    js: JetStreamContext, name: str, subjects: list[str], *, max_age_s: float, replicas: int = 1
) -> None:
    try:
        await js.stream_info(name)
        return
    except NotFoundError:
        pass
    cfg = StreamConfig(
        name=name,
        subjects=subjects,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=max_age_s,
        num_replicas=replicas,
    )
    with contextlib.suppress(nats.js.errors.BadRequestError):
        await js.add_stream(cfg)


async def ensure_all(js: JetStreamContext, subjects: Subjects, replicas: int = 1) -> dict[str, KeyValue]:
    """Every bucket and stream of the architecture; returns the buckets by name."""
    buckets = {
        subjects.bucket_assign: await ensure_kv(js, subjects.bucket_assign, replicas=replicas),
        subjects.bucket_routing: await ensure_kv(js, subjects.bucket_routing, replicas=replicas),
        subjects.bucket_desired: await ensure_kv(js, subjects.bucket_desired, history=5, replicas=replicas),
        subjects.bucket_replicas: await ensure_kv(js, subjects.bucket_replicas, replicas=replicas),
        subjects.bucket_keys: await ensure_kv(js, subjects.bucket_keys, replicas=replicas),
        subjects.bucket_leader: await ensure_kv(js, subjects.bucket_leader, ttl=10.0, replicas=replicas),
    }
    await ensure_stream(
        js, subjects.events_stream, [subjects.all_events()], max_age_s=7 * 86400, replicas=replicas
    )
    return buckets


class DropLog:
    """Logs one line per dropped message, without a traceback, and counts them."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.count = 0

    def drop(self, where: str, reason: str) -> None:
        self.count += 1
        # The subject is the sender's choice, control characters included: shown, never obeyed.
        self.logger.warning("dropped undecodable message on %s: %s", visible(where), visible(reason))


async def subscribe(
    nc: NATS,
    subject: str,
    cls: type[M],
    handler: Callable[[M, Msg], Awaitable[None] | None],
    drops: DropLog,
    queue: str = "",
) -> Subscription:
    """Subscribe with a typed handler; undecodable payloads are dropped with one log line."""

    async def cb(msg: Msg) -> None:
        try:
            m = decode(msg.data, cls)
        except DecodeError as e:
            drops.drop(msg.subject, str(e))
            return
        r = handler(m, msg)
        if r is not None:
            await r

    return await nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=65536)


async def sent(nc: NATS, timeout: int = 10) -> None:
    """Return once the server has everything this client sent so far, subscriptions included.

    nats-py's ``flush()`` writes its PING straight to the socket while SUB and PUB lines can still wait
    in the client's pending buffer for its flusher task, so one flush may come back before the server
    has registered a subscription made just before it (seen under load: a message published right
    after was never delivered). The second PING goes out after the flusher has run.
    """
    await nc.flush(timeout)
    await nc.flush(timeout)


async def kv_get(kv: KeyValue, key: str, cls: type[M], drops: DropLog | None = None) -> tuple[M | None, int]:
    """A key's decoded value and revision; (None, 0) when absent or undecodable."""
    try:
        e = await kv.get(key)
    except NotFoundError:  # absent, or deleted (KeyDeletedError is not a KeyNotFoundError)
        return None, 0
    if e.value is None:
        return None, 0
    try:
        return decode(e.value, cls), e.revision or 0
    except DecodeError as err:
        if drops is not None:
            drops.drop(f"{kv._name}/{key}", str(err))
        return None, e.revision or 0


async def kv_keys(kv: KeyValue) -> list[str]:
    try:
        return list(await kv.keys())
    except NoKeysError:
        return []


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
