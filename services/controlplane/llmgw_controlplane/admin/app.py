"""The console and ``/debug/stats`` as an app: pages rendered from a :class:`ConsoleSource`, GET only,
guarded to loopback host names unless the listener is deliberately public."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from llmgw_common.ctl import ExplainReply
from llmgw_controlplane.admin.listener import is_loopback
from llmgw_controlplane.admin.source import ConsoleSource, SourceUnavailable
from llmgw_controlplane.console import format as fmt

CONSOLE_DIR = Path(__file__).parent.with_name("console")
REFRESH_S = 10
# At most this many unplaceable models get a per-node explanation on the Placement page.
EXPLAIN_MAX = 20
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
        reply = await source.models()
        return await render("models", refresh, models=reply.models, adapters=reply.adapters)

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
