"""The simulated engine as a server: its aiohttp application (the routes of each API surface, from the
modules that hold them), bound and served.

Apart from :mod:`llmgw_sim.engine` (the engine's state and the helpers the API modules use), which
the API modules import: the application that imports them lives here, so no module imports its
importer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from llmgw_sim import (
    audio_api,
    cache_api,
    chat_routes,
    errors,
    lora_api,
    messages_api,
    pooling_api,
    responses_api,
    tokens_api,
)
from llmgw_sim.cluster import JOIN_PATH
from llmgw_sim.engine import ENGINE_KEY, Engine, FaultExit
from llmgw_sim.options import SimOptions

log = logging.getLogger("llmgw_sim.engine")


def build_app(opts: SimOptions, clock: Callable[[], float] = time.monotonic) -> web.Application:
    """The engine's aiohttp application; followers serve ``/health`` only.

    The routes are vLLM's for the runner the options name (all of them without one): a path of the
    other runner is not registered, so it gets vLLM's bare 404.
    """
    engine = Engine(opts, clock=clock)
    app = web.Application(client_max_size=64 * 1024**2, middlewares=[errors.vllm_shapes])
    app[ENGINE_KEY] = engine
    app.cleanup_ctx.append(engine.lifecycle)
    app.on_shutdown.append(engine.on_shutdown)
    app.router.add_get("/health", engine.health)
    if opts.is_follower:
        return app
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_get("/v1/models", engine.models)
    apis = (chat_routes, responses_api, messages_api, pooling_api, tokens_api, audio_api, cache_api, lora_api)
    for api in apis:
        api.add(app, engine)
    if opts.world > 1:
        app.router.add_post(JOIN_PATH, engine.join)
    return app


@dataclass(frozen=True, slots=True)
class Listening:
    """A started engine: its runner (``cleanup()`` stops it), state and bound address."""

    runner: web.AppRunner
    engine: Engine
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


async def start(opts: SimOptions) -> Listening:
    """Bind and start serving; the caller owns the returned runner and must ``cleanup()`` it."""
    app = build_app(opts)
    # handler_cancellation: a client that hangs up frees its slot, as vLLM aborts such a request.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, opts.host, opts.port, backlog=2048)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    return Listening(runner, app[ENGINE_KEY], host, port)


async def serve(opts: SimOptions, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set. Raises :class:`FaultExit` when the ``exit_after`` fault fired."""
    srv = await start(opts)
    engine = srv.engine
    try:
        role = f"rank {opts.rank}/{opts.world}" if opts.world > 1 else "single node"
        # One line on stdout that a parent process can read the bound port from.
        print(f"sim-engine listening on {srv.url} model={opts.model} ({role})", flush=True)
        log.info("serving %s on %s (pid %d)", opts.model, srv.url, os.getpid())
        stop_wait = asyncio.create_task(stop.wait(), name="sim-stop")
        exit_wait = asyncio.create_task(engine.exit_requested.wait(), name="sim-exit")
        try:
            await asyncio.wait({stop_wait, exit_wait}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stop_wait, exit_wait):
                t.cancel()
            await asyncio.gather(stop_wait, exit_wait, return_exceptions=True)
    finally:
        await srv.runner.cleanup()
    if engine.exit_requested.is_set() and not stop.is_set():
        raise FaultExit()
