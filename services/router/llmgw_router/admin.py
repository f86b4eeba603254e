"""The admin listener (loopback only): ``/metrics`` and ``/health``.

It stays on aiohttp.web: it is scraped a few times a minute, so its speed does not matter, and it is
not exposed to clients, so the OpenAI listener's deadlines and caps are not needed here.
"""

from __future__ import annotations

from aiohttp import web

from llmgw_router.context import RouterContext


def build_admin_app(ctx: RouterContext) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=ctx.metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text='{"status":"ok"}', content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app
