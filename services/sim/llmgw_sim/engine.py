"""The simulated engine: an OpenAI-compatible server with an engine's timing, slots and metrics.

Pipeline of one generation request: read JSON → check model and readiness → take a slot (or wait
in the queue) → look the prompt up in the prefix cache (when on) → first token after ``ttft_ms``
(plus the uncached tokens at ``prefill_tokens_per_s``) → store the prompt's blocks → one token per
``1/tokens_per_s`` → store the answer's blocks, release the slot. ``zero`` drops every delay, for
benchmarks. ``/metrics`` reads the slot counts, so running, waiting and KV use are what the server
is really doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmgw_common import simtokens
from llmgw_common.vllm_kv_events import KvEvent
from llmgw_sim import errors
from llmgw_sim import openai_bodies as bodies
from llmgw_sim.cluster import Membership, follow
from llmgw_sim.kv_publisher import KvEventPublisher
from llmgw_sim.lora import Adapters
from llmgw_sim.metrics import LoadSnapshot, sim_registry
from llmgw_sim.options import SimOptions
from llmgw_sim.prefix_cache import PrefixCache, Run, prefill_seconds
from llmgw_sim.slots import Slots

__all__ = [
    "ENGINE_KEY",
    "FAULT_EXIT_CODE",
    "Engine",
    "FaultExit",
    "Generation",
    "SimOptions",
    "sse_response",
]

log = logging.getLogger(__name__)

# The exit code of a process that left because of ``exit_after``: distinct from a clean stop (0).
FAULT_EXIT_CODE = 3

_JSON = "application/json"


class FaultExit(Exception):
    """``serve()`` stopped because the ``exit_after`` fault fired; the process should exit with ``code``."""

    def __init__(self, code: int = FAULT_EXIT_CODE) -> None:
        super().__init__(f"exit_after fault: exiting with code {code}")
        self.code = code


def _error(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
    return errors.error(status, message, type_, param)


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
        # Work that outlives its request (a background Responses API answer), cancelled likewise.
        self._background: set[asyncio.Task[Any]] = set()
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._prompt_s = 0.0
        self._gen_s = 0.0
        self._ttft_s = 0.0 if opts.zero else opts.ttft_ms / 1000.0
        self._tpot_s = 0.0 if opts.zero else 1.0 / opts.tokens_per_s
        self._prefill_rate = None if opts.zero else opts.prefill_tokens_per_s
        self.cache = PrefixCache(opts.block_size, opts.cache_blocks) if opts.caches_prefixes else None
        # Bound at startup (lifecycle), when the options ask for events.
        self.kv_events: KvEventPublisher | None = None
        # LoRA adapters loaded at run time (lora.py), where the options ask for them.
        self.lora: Adapters | None = None
        if opts.max_loras is not None:
            self.lora = Adapters(
                opts.model,
                opts.max_loras,
                opts.lora_capacity,
                max_rank=opts.max_lora_rank,
                load_s=opts.lora_load_s,
                check_files=opts.lora_check_files,
                wall=wall,
            )
        self.registry = sim_registry(opts.metrics_style, opts.model, self.snapshot, created=wall())

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
        lora = self.lora
        return LoadSnapshot(
            running=self.slots.running,
            # vLLM counts a request held back for its adapter (max_loras) as waiting ("deferred").
            waiting=self.slots.waiting + (lora.waiting if lora is not None else 0),
            slots=self.slots.capacity,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._gen_tokens,
            requests_total=self._served,
            prompt_seconds_total=self._prompt_s,
            generation_seconds_total=self._gen_s,
            kv_tokens_used=self._kv_used,
            kv_tokens=self.opts.kv_tokens,
            prefix_cache_queries=self.cache.queries if self.cache is not None else 0,
            prefix_cache_hits=self.cache.hits if self.cache is not None else 0,
            max_loras=self.opts.max_loras,
            lora_info=tuple(lora.info_series()) if lora is not None else (),
        )

    def _done(self, prompt: int, completion: int, ttft_s: float | None = None) -> None:
        self._served += 1
        self._prompt_tokens += prompt
        self._gen_tokens += completion
        self._prompt_s += self._ttft_s if ttft_s is None else ttft_s
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

    # ------------------------------------------------------------ handlers

    async def health(self, request: web.Request) -> web.Response:
        if self.opts.fail_health:
            return _error(503, "fault injected: fail_health", "ServiceUnavailableError")
        reason = self.not_ready_reason()
        if reason is not None:
            return _error(503, reason, "ServiceUnavailableError")
        # vLLM's /health is a bare 200.
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        # The content type vLLM serves (prometheus_client's CONTENT_TYPE_LATEST).
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def models(self, request: web.Request) -> web.Response:
        adapters = tuple(self.lora.loaded.values()) if self.lora is not None else ()
        body = bodies.model_list(
            self.opts.model, self.opts.max_model_len, self.instance, self.now(), adapters
        )
        return web.Response(body=json.dumps(body).encode(), content_type=_JSON)

    async def join(self, request: web.Request) -> web.Response:
        assert self.membership is not None
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            body = None
        refused = self.membership.join(body)
        if refused is not None:
            return _error(409 if body is not None else 400, refused, "BadRequestError")
        return web.Response(body=json.dumps({"world": self.opts.world}).encode(), content_type=_JSON)

    async def read_json(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object; refused as vLLM refuses a body that is not one."""
        if request.content_type != "application/json":
            raise errors.UNSUPPORTED_MEDIA
        return errors.json_object(await request.read())

    def refusal(self, model: str, param: str | None = "model") -> web.Response | None:
        """Why this engine will not serve ``model`` now ("" is its own model, as in vLLM; a loaded
        LoRA adapter is served too), or None.

        ``param`` of an unknown model's 404: vLLM's pooling endpoints leave it null. vLLM's message
        lists the base's name only, not its adapters'.
        """
        reason = self.not_ready_reason()
        if reason is not None:
            return _error(503, reason, "ServiceUnavailableError")
        if model and model != self.opts.model and self.adapter_of(model) is None:
            status, message, type_, _ = errors.model_not_found(model, self.opts.model)
            return _error(status, message, type_, param)
        return None

    def adapter_of(self, model: str) -> str | None:
        """``model`` when it names a loaded LoRA adapter, else None (the base, or not served)."""
        if self.lora is None or self.lora.lookup(model) is None:
            return None
        return model

    def served_name(self, model: str) -> str:
        """The name an answer carries: the adapter's when the request named one, else the base's."""
        return self.adapter_of(model) or self.opts.model

    # ------------------------------------------------------------ the work of one request

    @contextlib.asynccontextmanager
    async def slot(self, kv_tokens: int) -> AsyncIterator[None]:
        """Hold a slot (after the queue) and ``kv_tokens`` of KV cache while the body runs."""
        await self._take(kv_tokens)
        try:
            yield
        finally:
            self._give(kv_tokens)

    async def decode(self, n: int) -> None:
        """The time of a whole answer of ``n`` tokens: the first after ttft, then one per 1/tokens_per_s."""
        delay = self._ttft_s + max(n - 1, 0) * self._tpot_s
        if delay > 0:
            await asyncio.sleep(delay)

    async def prefill(self) -> None:
        """The time of reading a prompt, all a pooling request takes."""
        if self._ttft_s > 0:
            await asyncio.sleep(self._ttft_s)

    async def timed(self, n: int) -> AsyncIterator[range]:
        """Indexes of ``n`` tokens as they come due: one at a time, or all at once without delays."""
        if self._ttft_s == 0 and self._tpot_s == 0:
            yield range(n)
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(n):
            wait = start + self._ttft_s + i * self._tpot_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            yield range(i, i + 1)

    def done(self, prompt: int, completion: int, ttft_s: float | None = None) -> None:
        """Count a finished request in the metrics (and in the ``exit_after`` fault); ``ttft_s``: its
        prefill time, when not the engine's fixed one."""
        self._done(prompt, completion, ttft_s)

    @contextlib.asynccontextmanager
    async def generation(
        self, kv_tokens: int, prompt_tokens: int, body: dict[str, Any], lora: str | None = None
    ) -> AsyncIterator[Generation]:
        """Hold a slot for one generation request and time it: its prefill by the prefix cache's hit
        (when on) and the prefill speed. The body's tokens are read only when a cache is kept.
        ``lora``: the adapter it is for, which waits while ``max_loras`` others fill the batch."""
        async with self._adapter(lora) as reload_s:
            async with self.slot(kv_tokens):
                run: Run | None = None
                if self.cache is not None:
                    ids = simtokens.prompt_token_ids(body)
                    if ids is not None:
                        run = self.cache.begin(ids, cache_salt(body), lora)
                uncached = run.uncached_tokens if run is not None else prompt_tokens
                ttft = prefill_seconds(self._ttft_s, uncached, self._prefill_rate)
                gen = Generation(self, run, ttft + (0.0 if self.opts.zero else reload_s))
                try:
                    yield gen
                finally:
                    gen.end()

    @contextlib.asynccontextmanager
    async def _adapter(self, lora: str | None) -> AsyncIterator[float]:
        """A request's place among the adapters (none for the base): the seconds its adapter takes to
        be read again when it was no longer held in memory."""
        if lora is None or self.lora is None:
            yield 0.0
            return
        async with self.lora.request(lora) as reload_s:
            yield reload_s

    @property
    def tpot_s(self) -> float:
        """Seconds per generated token after the first."""
        return self._tpot_s

    def publish(self, events: list[KvEvent]) -> None:
        if self.kv_events is not None and events:
            self.kv_events.publish(events, self._wall())

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """vLLM's reset: False while requests hold blocks (unless ``force``); announced when done."""
        if self.cache is None:
            return True
        events = self.cache.reset(force)
        if events is None:
            return False
        self.publish(events)
        return True

    def rid(self, kind: str, sep: str = "-") -> str:
        return f"{kind}{sep}{self._id_prefix}{next(self._ids):x}"

    def now(self) -> int:
        return int(self._wall())

    async def tracked(self, work: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """Run a request's work as one the shutdown aborts."""
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
        for task in (*self._inflight, *self._background):
            task.cancel()

    def spawn(self, work: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Run ``work`` after its request has been answered; a shutdown cancels it."""

        async def run() -> None:
            await work

        task = asyncio.create_task(run(), name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def finish(
        self,
        request: web.Request,
        resp: web.Response,
        prompt: int,
        completion: int,
        ttft_s: float | None = None,
    ) -> web.Response:
        """Send a whole answer and count it."""
        if self.opts.exit_after is not None:
            # Send the answer before this count may stop the process.
            await resp.prepare(request)
            await resp.write_eof()
        self._done(prompt, completion, ttft_s)
        return resp

    # ------------------------------------------------------------ lifecycle

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """Background work of the engine: the loading delay and, for followers, joining the leader."""
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        if self.opts.kv_events_endpoint is not None and not self.opts.is_follower:
            self.kv_events = KvEventPublisher(self.opts.kv_events_endpoint, self.opts.kv_events_topic)
            log.info("publishing KV events on %s", self.opts.kv_events_endpoint)
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
            if self.kv_events is not None:
                self.kv_events.close()
                self.kv_events = None

    async def _load(self) -> None:
        await asyncio.sleep(self.opts.startup_s)
        self.loaded = True
        log.info("model %s loaded after %.1fs", self.opts.model, self.opts.startup_s)

    def _set_joined(self, joined: bool) -> None:
        self.joined = joined


def cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's per-request ``cache_salt``: it enters the first block's hash, so only requests with the
    same salt share cached blocks."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


class Generation:
    """One generation request's time in its slot: the prefill (``ttft_s``), after which its prompt's
    blocks are cached, then its tokens. Mark the answer :meth:`completed` for its blocks to be cached
    too; the engine ends it when the slot is released."""

    def __init__(self, engine: Engine, run: Run | None, ttft_s: float) -> None:
        self.engine = engine
        self.run = run
        self.ttft_s = ttft_s
        self._prefilled = False
        self._output: list[str] = []

    def prefilled(self) -> None:
        if self._prefilled:
            return
        self._prefilled = True
        cache = self.engine.cache
        if self.run is not None and cache is not None:
            self.engine.publish(cache.store(self.run))

    def completed(self, tokens: list[str]) -> None:
        """The whole answer was produced (its tokens as sent: a word, maybe after a space)."""
        self._output = tokens

    def end(self) -> None:
        cache = self.engine.cache
        if self.run is None or cache is None:
            return
        output = [simtokens.word_id(t.strip()) for t in self._output] if self._prefilled else []
        self.engine.publish(cache.finish(self.run, output))

    async def decode(self, n: int) -> None:
        """The time of a whole answer of ``n`` tokens: the first after the prefill, then one per
        1/tokens_per_s."""
        tpot = self.engine.tpot_s
        if self.ttft_s > 0:
            await asyncio.sleep(self.ttft_s)
        self.prefilled()
        rest = max(n - 1, 0) * tpot
        if rest > 0:
            await asyncio.sleep(rest)

    async def timed(self, n: int) -> AsyncIterator[range]:
        """Indexes of ``n`` tokens as they come due: one at a time, or all at once without delays."""
        tpot = self.engine.tpot_s
        if self.ttft_s == 0 and tpot == 0:
            self.prefilled()
            yield range(n)
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(n):
            wait = start + self.ttft_s + i * tpot - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self.prefilled()
            yield range(i, i + 1)


ENGINE_KEY = web.AppKey("engine", Engine)


def sse_response() -> web.StreamResponse:
    return web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
