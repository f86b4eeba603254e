"""The control plane's admin listener: the read-only console and ``/debug/stats``.

The pages are rendered from the same ctl views ``llmgw ctl`` prints (``views.py`` through
:class:`CtlApi`), so the console cannot disagree with the CLI. Nothing here writes: every route is
GET, and the app has no handle on anything that could mint a key or change desired state.

The listener binds loopback unless told otherwise: the same port serves debug endpoints that can
expose the process's memory, and pages carry the fleet's layout. Binding elsewhere needs
``allow_public`` and logs a warning. On loopback, requests must also name a loopback host, so a web
page that rebinds its DNS name to 127.0.0.1 cannot read the console from an operator's browser.
Forwarded headers (``X-Forwarded-*``) are never consulted (ARCHITECTURE #12).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import jinja2
import nats.errors
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from nats.micro.request import ServiceError

from llmgw_common.ctl import (
    DebugStatsReply,
    Empty,
    ExplainReply,
    ModelRequest,
    ModelsReply,
    NodesReply,
    ReplicasReply,
    ReplicasRequest,
    StatusReply,
)
from llmgw_common.errors import InvalidInput, Unavailable
from llmgw_common.messages import ClusterSettings
from llmgw_controlplane.console import format as fmt
from llmgw_controlplane.console.usage import UsageBook, UsageView

if TYPE_CHECKING:
    from llmgw_controlplane.api import CtlApi

CONSOLE_DIR = Path(__file__).with_name("console")
REFRESH_S = 10
# At most this many unplaceable models get a per-node explanation on the Placement page.
EXPLAIN_MAX = 20
LOOPBACK_NAMES = frozenset({"localhost"})
WEBHOOK_COMMAND = "llmgw setup --webhook URL"
PAGES = (
    ("/", "overview", "Overview"),
    ("/nodes", "nodes", "Nodes"),
    ("/models", "models", "Models"),
    ("/replicas", "replicas", "Replicas"),
    ("/placement", "placement", "Placement failures"),
    ("/usage", "usage", "Usage"),
)
_HEADERS = {
    "Cache-Control": "no-store",
    # No script may run on these pages, nothing may frame them, and nothing leaves with a referrer.
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class SourceUnavailable(Unavailable):
    """The control plane could not read its own state (e.g. NATS storage did not answer)."""


class AdminBindError(InvalidInput, RuntimeError):
    """The admin listener cannot bind as configured; the message says why and what to change."""


class ConsoleSource(Protocol):
    """What the console reads. The service passes :class:`CtlApiSource`; tests pass fixed data.

    Each method may raise :class:`SourceUnavailable`; the page then says so with a 503.
    """

    async def status(self) -> StatusReply: ...
    async def nodes(self) -> NodesReply: ...
    async def models(self) -> ModelsReply: ...
    async def replicas(self) -> ReplicasReply: ...
    async def explain(self, model: str) -> ExplainReply | None:
        """None when ``model`` is not (or no longer) in the catalog."""
        ...

    async def settings(self) -> ClusterSettings: ...
    async def usage(self) -> UsageView | None:
        """None when this control plane does not collect the routers' usage reports."""
        ...

    async def debug_stats(self) -> DebugStatsReply: ...


class CtlApiSource:
    """The live source: the very handlers that answer ``llmgw ctl``, called in-process."""

    def __init__(self, api: CtlApi, usage: UsageBook | None = None) -> None:
        self.api = api
        self.book = usage

    async def status(self) -> StatusReply:
        async with _unavailable("status"):
            return await self.api.status(Empty())

    async def nodes(self) -> NodesReply:
        async with _unavailable("nodes"):
            return await self.api.nodes(Empty())

    async def models(self) -> ModelsReply:
        async with _unavailable("models"):
            return await self.api.models(Empty())

    async def replicas(self) -> ReplicasReply:
        async with _unavailable("replicas"):
            return await self.api.replicas(ReplicasRequest())

    async def explain(self, model: str) -> ExplainReply | None:
        try:
            async with _unavailable("explain-placement"):
                return await self.api.explain(ModelRequest(model=model))
        except ServiceError:
            return None  # left the catalog between the status and this call

    async def settings(self) -> ClusterSettings:
        async with _unavailable("settings"):
            return (await self.api.settings_get(Empty())).settings

    async def usage(self) -> UsageView | None:
        return self.book.view() if self.book is not None else None

    async def debug_stats(self) -> DebugStatsReply:
        async with _unavailable("debug.stats"):
            return await self.api.debug_stats(Empty())


@contextlib.asynccontextmanager
async def _unavailable(what: str) -> Any:
    try:
        yield
    except (nats.errors.Error, TimeoutError) as e:
        raise SourceUnavailable(
            f"{what}: the control plane could not read its state from NATS ({e or type(e).__name__})"
        ) from None


# ---------------------------------------------------------------- the app


@dataclass
class RenderStats:
    """Per-page request counts and render times, shown under ``console`` in ``/debug/stats``."""

    counts: dict[str, int] = field(default_factory=dict)
    last_ms: dict[str, float] = field(default_factory=dict)
    max_ms: dict[str, float] = field(default_factory=dict)
    unavailable: int = 0

    def add(self, page: str, ms: float) -> None:
        self.counts[page] = self.counts.get(page, 0) + 1
        self.last_ms[page] = round(ms, 3)
        self.max_ms[page] = round(max(ms, self.max_ms.get(page, 0.0)), 3)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; any other name is not (it is never resolved here)."""
    h = host.strip().strip("[]").lower()
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host part of a Host header: ``[::1]:8081`` -> ``::1``, ``localhost:8081`` -> ``localhost``."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(CONSOLE_DIR),
        autoescape=True,  # every value is escaped; no template marks anything safe
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        dash=fmt.dash,
        duration=fmt.duration,
        utc=fmt.utc,
        thousands=fmt.thousands,
        counts=fmt.counts,
        tone=fmt.tone,
    )
    env.globals.update(bar=fmt.bar, ago=fmt.ago, until=fmt.until, attention=fmt.attention, pages=PAGES)
    return env


def _group_refusals(ex: ExplainReply) -> list[tuple[str, int, list[str]]]:
    """Refused nodes grouped by their reason, most common first: (reason, count, node names)."""
    groups: dict[str, list[str]] = {}
    for v in ex.nodes:
        if not v.ok:
            groups.setdefault("; ".join(v.reasons) or "refused", []).append(v.node)
    return sorted(((r, len(n), n) for r, n in groups.items()), key=lambda g: (-g[1], g[0]))


def build_admin_app(
    source: ConsoleSource,
    *,
    clock: Callable[[], float] = time.time,
    refresh_s: int = REFRESH_S,
    loopback_only: bool = True,
) -> FastAPI:
    """The console and debug endpoints over ``source``. GET only.

    ``loopback_only``: refuse requests whose Host header is not a loopback name (400); pass False when
    the listener is deliberately public.
    """
    env = _environment()
    stats = RenderStats()
    css = (CONSOLE_DIR / "style.css").read_bytes()
    app = FastAPI(title="llmgw console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.render_stats = stats

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if loopback_only and not is_loopback(_host_name(request.headers.get("host", ""))):
            resp: Response = PlainTextResponse(
                "this console answers only to a loopback host name (127.0.0.1, localhost, [::1]); "
                "start the control plane with allow_public_admin to serve it elsewhere\n",
                status_code=400,
            )
        else:
            resp = await call_next(request)
        resp.headers.update(_HEADERS)
        return resp

    @app.exception_handler(SourceUnavailable)
    async def unavailable(request: Request, exc: SourceUnavailable) -> Response:
        stats.unavailable += 1
        html = env.get_template("unavailable.html").render(
            page="", title="Unavailable", status=None, now=clock(), refresh_s=refresh_s, message=str(exc)
        )
        return HTMLResponse(html, status_code=503)

    async def render(page: str, refresh: int | None, **data: Any) -> HTMLResponse:
        t0 = time.perf_counter()
        title = next(t for _, p, t in PAGES if p == page)
        status = data.pop("status", None) or await source.status()
        html = env.get_template(f"{page}.html").render(
            page=page,
            title=title,
            status=status,
            now=clock(),
            refresh_s=refresh_s if refresh is None else refresh,
            **data,
        )
        stats.add(page, (time.perf_counter() - t0) * 1000)
        return HTMLResponse(html)

    Refresh = Query(None, ge=0, le=3600, description="Seconds between reloads; 0: none")

    @app.get("/", response_class=HTMLResponse)
    async def overview(refresh: int | None = Refresh) -> HTMLResponse:
        status = await source.status()
        settings = await source.settings()
        idle_ids = set(status.idle_replicas)
        idle = [r for r in (await source.replicas()).replicas if r.id in idle_ids] if idle_ids else []
        return await render(
            "overview",
            refresh,
            status=status,
            no_webhook=not settings.webhooks,
            webhook_command=WEBHOOK_COMMAND,
            # The webhook warning gets its own banner with the command; the rest are listed as they come.
            warnings=[w for w in status.warnings if "webhook" not in w]
            if not settings.webhooks
            else status.warnings,
            idle=idle,
        )

    @app.get("/nodes", response_class=HTMLResponse)
    async def nodes(refresh: int | None = Refresh) -> HTMLResponse:
        return await render("nodes", refresh, nodes=(await source.nodes()).nodes)

    @app.get("/models", response_class=HTMLResponse)
    async def models(refresh: int | None = Refresh) -> HTMLResponse:
        return await render("models", refresh, models=(await source.models()).models)

    @app.get("/replicas", response_class=HTMLResponse)
    async def replicas(refresh: int | None = Refresh) -> HTMLResponse:
        return await render("replicas", refresh, replicas=(await source.replicas()).replicas)

    @app.get("/placement", response_class=HTMLResponse)
    async def placement(refresh: int | None = Refresh) -> HTMLResponse:
        status = await source.status()
        unplaceable = {u.model for u in status.unplaceable}
        # Models without a ready replica for a reason other than placement (crash loop, starting).
        others = [
            m
            for m in (await source.models()).models
            if m.state not in ("ok", "off") and m.name not in unplaceable
        ]
        explained = []
        for u in status.unplaceable[:EXPLAIN_MAX]:
            ex = await source.explain(u.model)
            explained.append((u, ex, _group_refusals(ex) if ex is not None else []))
        return await render(
            "placement",
            refresh,
            status=status,
            explained=explained,
            not_explained=status.unplaceable[EXPLAIN_MAX:],
            others=others,
        )

    @app.get("/usage", response_class=HTMLResponse)
    async def usage(refresh: int | None = Refresh) -> HTMLResponse:
        return await render("usage", refresh, usage=await source.usage())

    @app.get("/style.css")
    async def style() -> Response:
        return Response(css, media_type="text/css; charset=utf-8")

    @app.get("/debug/stats")
    async def debug_stats() -> JSONResponse:
        cp = await source.debug_stats()
        return JSONResponse(
            {
                **cp.model_dump(mode="json"),
                "console": {
                    "requests": stats.counts,
                    "render_last_ms": stats.last_ms,
                    "render_max_ms": stats.max_ms,
                    "unavailable": stats.unavailable,
                },
            }
        )

    return app


# ---------------------------------------------------------------- the listener


class _Server(uvicorn.Server):
    """uvicorn, minus its signal handlers: the process's own handlers set ``stop`` (runtime.run_service)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


class AdminServer:
    """The admin listener: :meth:`start` binds (or raises :class:`AdminBindError`) and serves; :meth:`close`."""

    def __init__(self, app: FastAPI, host: str, port: int, allow_public: bool, log: logging.Logger) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.allow_public = allow_public
        self.log = log
        self.bound_port: int | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    def _bind(self) -> socket.socket:
        if not is_loopback(self.host):
            if not self.allow_public:
                raise AdminBindError(
                    f"the admin listener would bind {self.host!r}, which is not loopback: it serves the console "
                    "and debug endpoints that can expose the control plane's memory. Bind 127.0.0.1 (and reach "
                    "it through an SSH tunnel), or set allow_public_admin (LLMGW_ALLOW_PUBLIC_ADMIN=1) to "
                    "serve it there anyway"
                )
            self.log.warning(
                "admin listener bound to %s, off loopback (allow_public_admin): it serves the console and "
                "debug endpoints that can expose the control plane's memory to anyone who can reach it",
                self.host,
            )
        try:
            infos = socket.getaddrinfo(
                self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except socket.gaierror as e:
            raise AdminBindError(f"admin listener: cannot resolve {self.host!r}: {e.strerror}") from None
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError as e:
            sock.close()
            raise AdminBindError(
                f"admin listener: cannot bind {self.host}:{self.port} ({e.strerror}); "
                "choose another --admin-port, or 0 for none"
            ) from None
        sock.setblocking(False)
        return sock

    async def start(self) -> int:
        """Bind and start serving; the bound port (the real one when asked for port 0)."""
        sock = self._sock = self._bind()
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            proxy_headers=False,  # forwarded headers are never trusted (ARCHITECTURE #12)
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=2,
            ws="none",
        )
        server = self._server = _Server(config)
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="cp-admin")
        ready = asyncio.create_task(server.ready.wait())
        await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            await self._task  # raises what the start raised
            raise AdminBindError("admin listener stopped while starting")
        self.bound_port = sock.getsockname()[1]
        self.log.info("console on http://%s/ (read-only)", _url_host(self.host, self.bound_port))
        return self.bound_port

    async def close(self) -> None:
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        server.should_exit = True
        await asyncio.wait({task})  # our own cancellation still propagates; the task's outcome does not
        if not task.cancelled() and (e := task.exception()) is not None:
            self.log.warning("admin listener ended with an error: %s", e)
        # A listener that died without its own shutdown leaves these open.
        for srv in getattr(server, "servers", ()):
            srv.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _url_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_admin(
    app: FastAPI,
    host: str,
    port: int,
    allow_public: bool,
    stop: asyncio.Event,
    log: logging.Logger,
    on_bound: Callable[[int], None] | None = None,
) -> None:
    """Serve ``app`` until ``stop`` is set. Raises :class:`AdminBindError` before serving when it cannot bind.

    ``on_bound`` receives the bound port (the real one for port 0) once the listener accepts connections.
    """
    server = AdminServer(app, host, port, allow_public, log)
    bound = await server.start()
    try:
        if on_bound is not None:
            on_bound(bound)
        await stop.wait()
    finally:
        await server.close()
