"""vLLM's ``POST /reset_prefix_cache``: drop every cached block, announced as ``AllBlocksCleared``.

vLLM 0.32 serves it only in dev mode (``VLLM_SERVER_DEV_MODE=1``, ``entrypoints/serve/dev/cache``);
the simulator serves it where it keeps a prefix cache. It answers ``{"success": bool}``: false while
running requests hold blocks, unless ``?reset_running_requests=true`` (vLLM then preempts them; here
they run on and cache nothing more).
"""

from __future__ import annotations

import json

from aiohttp import web

from llmgw_sim.engine import Engine

_JSON = "application/json"


def add(app: web.Application, engine: Engine) -> None:
    if engine.cache is None or not engine.opts.generates:
        return

    async def reset(request: web.Request) -> web.Response:
        force = request.query.get("reset_running_requests", "false").lower() in ("1", "true", "yes", "on")
        ok = engine.reset_prefix_cache(force)
        return web.Response(body=json.dumps({"success": ok}).encode(), content_type=_JSON)

    app.router.add_post("/reset_prefix_cache", reset)
