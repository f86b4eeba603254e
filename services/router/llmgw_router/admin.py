"""The admin listener (loopback only): ``/metrics``, ``/health`` and ``/routing`` (what this router holds
of the routing table: its version and counts, or one model's endpoints with ``?model=``).

It stays on aiohttp.web: it is scraped a few times a minute, so its speed does not matter, and it is
not exposed to clients, so the OpenAI listener's deadlines and caps are not needed here.
"""

from __future__ import annotations

import json

from aiohttp import web

from llmgw_router.context import RouterContext


def build_admin_app(ctx: RouterContext) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=ctx.metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text='{"status":"ok"}', content_type="application/json")

    async def routing(req: web.Request) -> web.Response:
        pool = ctx.pool
        out: dict[str, object] = {"version": pool.endpoints_version, "table_read": pool.table_read}
        model = req.query.get("model")
        if model is None:
            out["models"] = len(pool.by_model)
            out["endpoints"] = len(pool.by_key)
        else:
            out["endpoints"] = [
                {"replica": e.replica_id, "url": e.url, "node": e.node, "draining": e.draining}
                for e in pool.by_model.get(model, ())
            ]
        return web.Response(text=json.dumps(out), content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/routing", routing)
    return app
