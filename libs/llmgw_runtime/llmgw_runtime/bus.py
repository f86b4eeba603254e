"""Bus helpers: connect with reconnects, ensure buckets and streams, typed subscriptions, KV reads (the
KV follower is :mod:`llmgw_runtime.kv_follower`).

Everything here follows shared/design/NATS-NOTES.md: a short ping interval, endless reconnects,
bind-before-create for buckets, callbacks rather than ``sub.messages``, and a periodic full resync
behind every KV watch because the watcher's end-of-initial-values marker can arrive early.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from pydantic import BaseModel

from llmgw_common.codec import DecodeError, decode
from llmgw_common.names import visible
from llmgw_common.subjects import Subjects
from llmgw_runtime.settings import BusSettings

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
    direct: bool = True,
) -> KeyValue:
    """Bind to a bucket, creating it only when it does not exist (a config mismatch would fail).

    ``direct=False`` for a bucket whose reads must come from its stream's leader, never from a replica
    that may be cut off from it."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    # direct=True: reads of one key go to $JS.API.DIRECT.GET.<stream>.<key subject>, a subject that
    # per-role permissions can grant key by key (an agent reads only its own assignment).
    cfg = KeyValueConfig(bucket=bucket, history=history, ttl=ttl, replicas=replicas, direct=direct)
    try:
        return await js.create_key_value(config=cfg)
    except nats.js.errors.BadRequestError:
        # Someone else created it between our bind and create.
        return await js.key_value(bucket)


class LeaderReads(KeyValue):
    """The same bucket, every read answered by its stream's leader: a get by ``$JS.API.STREAM.MSG.GET``
    (only the leader answers it), not a direct get (any replica answers those, one still catching up
    included), and :meth:`keys` from the leader's stream info, not an ordered consumer's scan.

    For a control plane, whose reads at a takeover must see every write acknowledged before it: right
    after a heal (partition case 4b) a takeover through the rejoined nats-server read that server's copy,
    still behind; it loaded a replica record its predecessor had deleted, waited out its startup timeout
    (30 s) for a replica no node ran, and read the lease as another's and stepped down. Writes and
    watches are those of any bucket. A deleted key is listed (its delete marker is a message) and read
    as absent, as ``get`` says of deleted keys."""

    async def keys(self, filters: list[str] | None = None, **kwargs: object) -> list[str]:
        keys = await kv_keys(self)
        if filters:
            keys = [k for k in keys if any(f in k for f in filters)]
        if not keys:
            raise NoKeysError
        return keys


async def forget_key(kv: KeyValue, key: str) -> None:
    """Remove every message of ``key`` from its bucket's stream, leaving no delete marker. For a bucket
    nobody watches and whose keys a reader lists (:class:`LeaderReads` lists a deleted key, since its
    marker is a message): a marker per deleted key would grow for ever, one more get at each takeover."""
    await kv._js.purge_stream(kv._stream, subject=f"{kv._pre}{key}")


def leader_reads(kv: KeyValue) -> KeyValue:
    """``kv`` read from its stream's leader (:class:`LeaderReads`)."""
    return LeaderReads(name=kv._name, stream=kv._stream, pre=kv._pre, js=kv._js, direct=False)


async def ensure_object_store(js: JetStreamContext, bucket: str, *, replicas: int = 1) -> ObjectStore:
    """Bind to an object store, creating it only when it does not exist (as :func:`ensure_kv`)."""
    try:
        return await js.object_store(bucket)
    except BucketNotFoundError:
        pass
    try:
        return await js.create_object_store(
            bucket, config=ObjectStoreConfig(bucket=bucket, replicas=replicas)
        )
    except nats.js.errors.BadRequestError:
        # Someone else created it between our bind and create.
        return await js.object_store(bucket)


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
    """Every bucket and stream of the architecture but the control planes' own ``bucket_announced``
    (made by the first leader: only control planes use it); returns the buckets by name."""
    buckets = {
        subjects.bucket_assign: await ensure_kv(js, subjects.bucket_assign, replicas=replicas),
        subjects.bucket_routing: await ensure_kv(js, subjects.bucket_routing, replicas=replicas),
        subjects.bucket_desired: await ensure_kv(js, subjects.bucket_desired, history=5, replicas=replicas),
        subjects.bucket_replicas: await ensure_kv(js, subjects.bucket_replicas, replicas=replicas),
        subjects.bucket_keys: await ensure_kv(js, subjects.bucket_keys, replicas=replicas),
        subjects.bucket_leader: await ensure_kv(js, subjects.bucket_leader, ttl=10.0, replicas=replicas),
        subjects.bucket_usage: await ensure_kv(js, subjects.bucket_usage, replicas=replicas),
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


# A flush's PONG is awaited this long in its own task, whatever the caller's timeout: see flush().
_PONG_WAIT_S = 60
_flushes: set[asyncio.Task[None]] = set()
_PING = b"PING\r\n"


def _settled(t: asyncio.Task[None]) -> None:
    _flushes.discard(t)
    if not t.cancelled():
        t.exception()  # retrieved: the caller that wanted it may be gone


async def flush(nc: NATS, timeout: float = 10) -> None:
    """Return once the server has processed everything this client sent so far, subscriptions included;
    ``FlushTimeoutError`` after ``timeout``. Services call this, never ``nc.flush()``, for two reasons:

    - nats-py 2.16's ``flush()`` writes its PING straight to the socket while SUB and PUB lines still
      wait in the client's buffer for its flusher task: the PING goes out **first**, and the PONG can
      come back before the server has seen a subscription made just before (seen under load: a message
      published right after it was never delivered). Here the buffer is written, then the PING, in one
      step with no await between, so the PONG answers for both.
    - nats-py resolves a flush's future when the PONG arrives; if that future was cancelled first (the
      caller cancelled mid-flush, or ``nc.flush``'s own timeout cancels it) the PONG raises
      InvalidStateError in the client's read loop, which ends: the client says it is connected but
      reads nothing until the stale-ping check reconnects it (seen: a control plane gave its lease up
      10 s late). So the PONG is awaited in a task of its own, never cancelled, and the caller waits for
      that task with its own timeout.
    """
    t = asyncio.ensure_future(_ping(nc))
    _flushes.add(t)
    t.add_done_callback(_settled)
    try:
        await asyncio.wait_for(asyncio.shield(t), timeout)
    except TimeoutError:
        raise nats.errors.FlushTimeoutError from None


async def _ping(nc: NATS) -> None:
    transport = nc._transport
    pending, pongs = getattr(nc, "_pending", None), getattr(nc, "_pongs", None)
    if (
        not nc.is_connected
        or transport is None
        or not isinstance(pending, list)
        or not isinstance(pongs, list)
    ):
        # Reconnecting (nats-py's own path raises or buffers), or a nats-py whose insides differ.
        await nc.flush(_PONG_WAIT_S)
        return
    pong: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    # What the flusher task would write, then the PING: the order on the wire is the order of nc._pongs,
    # as every other writer of a PING (nats-py's ping timer) also appends and writes in one step.
    if pending:
        transport.writelines(pending[:])
        nc._pending = []
        nc._pending_data_size = 0
    pongs.append(pong)
    transport.write(_PING)
    # Not wait_for: it would cancel the future on timeout, the very thing that ends the read loop.
    done, _ = await asyncio.wait({pong}, timeout=_PONG_WAIT_S)
    if not done:
        raise nats.errors.FlushTimeoutError


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
    """Every key of ``kv`` with a message in its stream, a deleted key's marker included (a caller reads
    each key, and a get says a deleted key is absent).

    From the stream's info (``$JS.API.STREAM.INFO`` with a subjects filter: the stream's leader answers
    with every subject it holds), not nats-py's ``kv.keys()``: that scans with an ordered consumer and
    stops at an end-of-values marker which can come before the values (nats.py #842) — a listing of none
    of a bucket's 31 keys was seen in a test. A short listing made ``keys revoke`` say a key did not
    exist, and would have let a restarting router read none of its month's usage (its budgets reset).
    The same permission a role needs to bind the bucket covers it; no consumer is created."""
    return await stream_subjects(kv._js, kv._stream, kv._pre)


async def stream_subjects(js: JetStreamContext, stream: str, pre: str) -> list[str]:
    """The subjects under ``pre`` holding a message in ``stream``, ``pre`` cut off, every page of them
    (the server answers at most ``limit`` subjects at a time: 100,000 in nats-server 2.15)."""
    out: list[str] = []
    while True:
        req = {"subjects_filter": f"{pre}>", "offset": len(out)}
        resp = await js._api_request(
            f"{js._prefix}.STREAM.INFO.{stream}", json.dumps(req).encode(), js._timeout
        )
        page = (resp.get("state") or {}).get("subjects") or {}
        n = len(pre)
        out += (s[n:] for s in page)
        if not page or len(out) >= int(resp.get("total") or 0):
            return out
