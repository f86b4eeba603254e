"""The simulated engine: an OpenAI-compatible server with an engine's timing, slots and metrics.

Pipeline of one generation request: read JSON → check model and readiness → take a slot (or wait
in the queue) → first token after ``ttft_ms`` → one token per ``1/tokens_per_s`` → release the slot.
``zero`` drops every delay, for benchmarks. ``/metrics`` reads the slot counts, so running, waiting
and KV use are what the server is really doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmgw_sim import openai_api as oai
from llmgw_sim.cluster import JOIN_PATH, Membership, follow
from llmgw_sim.metrics import LoadSnapshot, render
from llmgw_sim.options import SimOptions
from llmgw_sim.slots import Slots

__all__ = ["FAULT_EXIT_CODE", "FaultExit", "Listening", "SimOptions", "build_app", "serve", "start"]

log = logging.getLogger(__name__)

# The exit code of a process that left because of ``exit_after``: distinct from a clean stop (0).
FAULT_EXIT_CODE = 3

_JSON = "application/json"


class FaultExit(Exception):
    """``serve()`` stopped because the ``exit_after`` fault fired; the process should exit with ``code``."""

    def __init__(self, code: int = FAULT_EXIT_CODE) -> None:
        super().__init__(f"exit_after fault: exiting with code {code}")
        self.code = code


def _error(
    status: int, message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> web.Response:
    return web.Response(status=status, body=oai.error_body(message, type_, code, param), content_type=_JSON)


class Engine:
    """State of one simulated engine process; handlers are its methods."""

    def __init__(
        self,
        opts: SimOptions,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.opts = opts
        self.slots = Slots(opts.slots)
        self.loaded = opts.startup_s == 0
        self.joined = False  # followers: accepted by the leader
        self.membership = Membership(opts.world, opts.heartbeat_s, clock) if opts.rank == 0 else None
        self.instance = uuid.uuid4().hex[:12]
        self.exit_requested = asyncio.Event()
        self._wall = wall
        self._ids = itertools.count(1)
        self._id_prefix = self.instance[:8]
        self._served = 0
        self._kv_used = 0
        # Handler tasks of generation requests, cancelled at shutdown so that a stop is prompt.
        self._inflight: set[asyncio.Task[Any]] = set()
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._prompt_s = 0.0
        self._gen_s = 0.0
        self._ttft_s = 0.0 if opts.zero else opts.ttft_ms / 1000.0
        self._tpot_s = 0.0 if opts.zero else 1.0 / opts.tokens_per_s

    # ------------------------------------------------------------ readiness

    def not_ready_reason(self) -> str | None:
        """Why this engine cannot serve now, or None when it can."""
        if not self.loaded:
            return "Loading model"
        if self.opts.is_follower:
            return None if self.joined else f"rank {self.opts.rank} has not joined leader {self.opts.leader}"
        if self.membership is not None and self.opts.world > 1:
            missing = self.membership.missing()
            if missing:
                ranks = ", ".join(str(r) for r in missing)
                return (
                    f"waiting for followers: rank(s) {ranks} of world {self.opts.world} not joined or silent"
                )
        return None

    def snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(
            running=self.slots.running,
            waiting=self.slots.waiting,
            slots=self.slots.capacity,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._gen_tokens,
            requests_total=self._served,
            prompt_seconds_total=self._prompt_s,
            generation_seconds_total=self._gen_s,
            kv_tokens_used=self._kv_used,
            kv_tokens=self.opts.kv_tokens,
        )

    def _done(self, prompt: int, completion: int) -> None:
        self._served += 1
        self._prompt_tokens += prompt
        self._gen_tokens += completion
        self._prompt_s += self._ttft_s
        self._gen_s += max(completion - 1, 0) * self._tpot_s
        limit = self.opts.exit_after
        if limit is not None and self._served >= limit and not self.exit_requested.is_set():
            log.warning("exit_after fault: served %d request(s), exiting", self._served)
            self.exit_requested.set()

    async def _take(self, kv_tokens: int) -> None:
        """A slot (waiting in the queue when none is free), and room for ``kv_tokens`` in the KV cache."""
        await self.slots.acquire()
        self._kv_used += kv_tokens

    def _give(self, kv_tokens: int) -> None:
        self._kv_used -= kv_tokens
        self.slots.release()

    def _rid(self, kind: str) -> str:
        return f"{kind}-{self._id_prefix}{next(self._ids):x}"

    # ------------------------------------------------------------ handlers

    async def health(self, request: web.Request) -> web.Response:
        if self.opts.fail_health:
            return _error(503, "fault injected: fail_health", "unavailable_error", 503)
        reason = self.not_ready_reason()
        if reason is not None:
            return _error(503, reason, "unavailable_error", 503)
        return web.Response(body=b'{"status":"ok"}', content_type=_JSON)

    async def metrics(self, request: web.Request) -> web.Response:
        text = render(self.opts.metrics_style, self.snapshot(), self.opts.model)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        body = {
            "object": "list",
            "data": [{"id": self.opts.model, "object": "model", "created": 0, "owned_by": "llmgw-sim"}],
        }
        return web.Response(body=json.dumps(body).encode(), content_type=_JSON)

    async def join(self, request: web.Request) -> web.Response:
        assert self.membership is not None
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            body = None
        refused = self.membership.join(body)
        if refused is not None:
            return _error(409 if body is not None else 400, refused, "invalid_request_error")
        return web.Response(body=json.dumps({"world": self.opts.world}).encode(), content_type=_JSON)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise oai.BadRequest(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise oai.BadRequest("request body must be a JSON object")
        return body

    def _refusal(self, model: str) -> web.Response | None:
        reason = self.not_ready_reason()
        if reason is not None:
            return _error(503, reason, "unavailable_error", 503)
        if model != self.opts.model:
            return _error(
                404,
                f"The model `{model}` does not exist. This engine serves `{self.opts.model}`.",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(self._generate(request, chat=True))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(self._generate(request, chat=False))

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(self._embed(request))

    async def _tracked(self, work: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            return await work
        finally:
            self._inflight.discard(task)

    async def on_shutdown(self, app: web.Application) -> None:
        """Abort generations in progress, as an engine does when it stops, instead of waiting them out."""
        if self._inflight:
            log.info("stopping: aborting %d request(s) in progress", len(self._inflight))
        for task in self._inflight:
            task.cancel()

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            read = oai.read_chat if chat else oai.read_completion
            req = read(body, self.opts.default_max_tokens)
        except oai.BadRequest as e:
            return _error(400, str(e), "invalid_request_error", None, e.param)
        refusal = self._refusal(req.model)
        if refusal is not None:
            return refusal
        rid = self._rid("chatcmpl" if chat else "cmpl")
        created = int(self._wall())
        tokens = oai.completion_tokens(req)
        if req.stream:
            return await self._stream(request, req, rid, created, tokens, chat)
        kv = req.prompt_tokens + len(tokens)
        await self._take(kv)
        try:
            delay = self._ttft_s + max(len(tokens) - 1, 0) * self._tpot_s
            if delay > 0:
                await asyncio.sleep(delay)
        finally:
            self._give(kv)
        build = oai.chat_response if chat else oai.completion_response
        resp = web.Response(body=json.dumps(build(rid, created, req, tokens)).encode(), content_type=_JSON)
        return await self._finish(request, resp, req.prompt_tokens, len(tokens))

    async def _finish(
        self, request: web.Request, resp: web.Response, prompt: int, completion: int
    ) -> web.Response:
        if self.opts.exit_after is not None:
            # Send the answer before this count may stop the process.
            await resp.prepare(request)
            await resp.write_eof()
        self._done(prompt, completion)
        return resp

    async def _stream(
        self,
        request: web.Request,
        req: oai.GenRequest,
        rid: str,
        created: int,
        tokens: list[str],
        chat: bool,
    ) -> web.StreamResponse:
        w = oai.ChunkWriter(rid, created, req, chat)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        # Headers go out at once, as vLLM's do; the first chunk waits for a slot and the first token.
        await resp.prepare(request)
        kv = req.prompt_tokens + len(tokens)
        await self._take(kv)
        try:
            if self._ttft_s == 0 and self._tpot_s == 0:
                await resp.write((w.first() + "".join(map(w.token, tokens)) + w.end(len(tokens))).encode())
            else:
                loop = asyncio.get_running_loop()
                start = loop.time()
                for i, tok in enumerate(tokens):
                    wait = start + self._ttft_s + i * self._tpot_s - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    await resp.write(((w.first() if i == 0 else "") + w.token(tok)).encode())
                await resp.write(w.end(len(tokens)).encode())
        finally:
            self._give(kv)
        await resp.write_eof()
        self._done(req.prompt_tokens, len(tokens))
        return resp

    async def _embed(self, request: web.Request) -> web.Response:
        try:
            req = oai.read_embeddings(await self._body(request), self.opts.embedding_dims)
        except oai.BadRequest as e:
            return _error(400, str(e), "invalid_request_error", None, e.param)
        refusal = self._refusal(req.model)
        if refusal is not None:
            return refusal
        await self._take(req.prompt_tokens)
        try:
            if self._ttft_s > 0:
                await asyncio.sleep(self._ttft_s)
        finally:
            self._give(req.prompt_tokens)
        resp = web.Response(body=json.dumps(oai.embeddings_response(req)).encode(), content_type=_JSON)
        return await self._finish(request, resp, req.prompt_tokens, 0)

    # ------------------------------------------------------------ lifecycle

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """Background work of the engine: the loading delay and, for followers, joining the leader."""
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        if not self.loaded:
            tasks.append(asyncio.create_task(self._load(), name="sim-load"))
        if self.opts.is_follower:
            assert self.opts.leader is not None
            tasks.append(
                asyncio.create_task(
                    follow(
                        self.opts.leader,
                        self.opts.rank,
                        self.opts.world,
                        self.instance,
                        self.opts.heartbeat_s,
                        self._set_joined,
                        stop,
                    ),
                    name="sim-follow",
                )
            )
        try:
            yield
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    async def _load(self) -> None:
        await asyncio.sleep(self.opts.startup_s)
        self.loaded = True
        log.info("model %s loaded after %.1fs", self.opts.model, self.opts.startup_s)

    def _set_joined(self, joined: bool) -> None:
        self.joined = joined


ENGINE_KEY = web.AppKey("engine", Engine)


def build_app(opts: SimOptions, clock: Callable[[], float] = time.monotonic) -> web.Application:
    """The engine's aiohttp application; followers serve ``/health`` only."""
    engine = Engine(opts, clock=clock)
    app = web.Application(client_max_size=64 * 1024**2)
    app[ENGINE_KEY] = engine
    app.cleanup_ctx.append(engine.lifecycle)
    app.on_shutdown.append(engine.on_shutdown)
    app.router.add_get("/health", engine.health)
    if opts.is_follower:
        return app
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_post("/v1/chat/completions", engine.chat)
    app.router.add_post("/v1/completions", engine.completions)
    app.router.add_post("/v1/embeddings", engine.embeddings)
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
