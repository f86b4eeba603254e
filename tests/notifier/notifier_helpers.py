"""Notifier test parts: real HTTP receivers and bus helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
from aiohttp import web
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo
from nats.js.kv import KeyValue

from llmgw_common.catalog import Catalog, ModelProfile, WatchSpec
from llmgw_common.codec import decode, encode
from llmgw_common.messages import ClusterSettings, Event, RoutingCatalog, Webhook
from llmgw_common.subjects import DESIRED_SETTINGS, ROUTING_CATALOG, Subjects
from llmgw_notifier.service import serve
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.stats import NotifierStats
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually


class FakeTime:
    """A clock and a sleep that only move when slept on: retry schedules without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, d: float) -> None:
        self.sleeps.append(d)
        self.now += d


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    status: int = 0  # what the receiver answered (0: no answer, the client went away)

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def event_id(self) -> str:
        return self.headers.get("X-Llmgw-Event-Id", "")


class Receiver:
    """A real webhook receiver on 127.0.0.1. ``answer(received) -> status`` scripts its replies; a
    request whose id is in ``hang_on`` waits until ``release`` is set (or the client goes away)."""

    def __init__(self) -> None:
        self.requests: list[Received] = []
        self.answer: Callable[[Received], int] = lambda r: 200
        self.hang_on: set[str] = set()
        self.release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    @property
    def ids(self) -> list[str]:
        return [r.event_id for r in self.requests]

    def taken(self) -> list[Received]:
        """Requests answered 2xx."""
        return [r for r in self.requests if 200 <= r.status < 300]

    async def _handle(self, request: web.Request) -> web.Response:
        rec = Received(dict(request.headers), await request.read())
        self.requests.append(rec)
        if rec.event_id in self.hang_on:
            await self.release.wait()
        status = self.answer(rec)
        rec.status = status
        return web.Response(status=status, text="ok")

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)  # what loop.create_server made: it has sockets
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


class Bus:
    def __init__(
        self, nc: Any, js: JetStreamContext, subjects: Subjects, buckets: dict[str, KeyValue]
    ) -> None:
        self.nc = nc
        self.js = js
        self.subjects = subjects
        self.buckets = buckets

    async def set_webhooks(self, *hooks: Webhook) -> None:
        await self.buckets[self.subjects.bucket_desired].put(
            DESIRED_SETTINGS, encode(ClusterSettings(webhooks=hooks))
        )

    async def set_watched(self, watched: dict[str, WatchSpec | None]) -> None:
        models = tuple(ModelProfile(name=n, engine="sim", watch=w) for n, w in watched.items())
        rc = RoutingCatalog(version=int(time.time() * 1000), catalog=Catalog(models=models))
        await self.buckets[self.subjects.bucket_routing].put(ROUTING_CATALOG, encode(rc))

    async def publish(self, ev: Event) -> None:
        await self.js.publish(
            self.subjects.event(ev.kind),
            encode(ev),
            stream=self.subjects.events_stream,
            headers={"Nats-Msg-Id": ev.id},
        )

    async def events(self, kinds: tuple[str, ...] | None = None) -> list[Event]:
        """Every event in the stream, in order (optionally only some kinds)."""
        info = await self.js.stream_info(self.subjects.events_stream)
        out: list[Event] = []
        if not info.state.messages:
            return out
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                raw = await self.js.get_msg(self.subjects.events_stream, seq)
                assert raw.data is not None
                ev = decode(raw.data, Event)
                if kinds is None or ev.kind in kinds:
                    out.append(ev)
        return out

    async def settled(self, name: str, timeout: float = 10.0) -> ConsumerInfo:
        """The consumer's info once it has nothing left to deliver or to see acknowledged (both lag)."""

        async def info_if_settled() -> ConsumerInfo | None:
            info = await self.js.consumer_info(self.subjects.events_stream, name)
            return info if info.num_pending == 0 and info.num_ack_pending == 0 else None

        info = await eventually(
            info_if_settled,
            timeout=timeout,
            what=f"consumer {name} to have nothing pending or awaiting acknowledgement",
        )
        assert info is not None  # eventually returns only a truthy value
        return info

    async def wait_consumer(self, name: str, present: bool = True, timeout: float = 10.0) -> None:
        async def as_wanted() -> bool:
            return (name in await self.consumer_names()) == present

        await eventually(
            as_wanted, timeout=timeout, what=f"consumer {name} to {'appear' if present else 'go away'}"
        )

    async def consumer_names(self) -> list[str]:
        return [c.name for c in await self.js.consumers_info(self.subjects.events_stream)]


def ev(kind: str, subject: str, n: int = 0, t: float | None = None, **details: Any) -> Event:
    return Event(
        id=f"{kind}:{subject}:{n}",
        kind=kind,
        subject=subject,
        time=time.time() if t is None else t,
        summary=f"{kind} {subject} #{n}",
        details=details,
    )


def fast_settings(nats_server: NatsServer, prefix: str, **kw: Any) -> NotifierSettings:
    base: dict[str, Any] = dict(
        nats_urls=[nats_server.url],
        prefix=prefix,
        group_window_s=0.0,
        retry_for_s=20.0,
        retry_base_s=0.05,
        retry_max_s=0.2,
        http_timeout_s=2.0,
        ack_wait_s=2.0,
        router_url="http://127.0.0.1:9",
    )
    base.update(kw)
    return NotifierSettings(**base)


@contextlib.asynccontextmanager
async def running(s: NotifierSettings) -> AsyncIterator[NotifierStats]:
    """The notifier in this process, stopped cleanly (and checked to have stopped) on exit."""
    stats = NotifierStats()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(s, stop, stats))
    try:
        yield stats
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
