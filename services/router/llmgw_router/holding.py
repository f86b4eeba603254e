"""Requests held, not refused, while a replica of their model is on its way (issues 13 and 14).

A request for a model without a ready endpoint is held when the routing endpoints say a replica is
coming (``RoutingEndpoints.coming``: starting, replacing a drained or failed one), when the model is
cold (scaled to zero, ``RoutingEndpoints.cold``), or when no routing endpoints were read yet (a cluster
coming up: the router knows the catalog before a control plane leads); it is refused at once (503, the
control plane's reason) when nothing is coming. For a cold model the router asks the control plane to
wake it: one WakeRequest in flight per model, asked again every ``wake_every_s`` while requests are
held (a leader change may lose a wake). Held requests are released by the routing update that brings
an endpoint (:meth:`Holding.update`, called by the routing KV follower), not by polling.

Bounds: held requests take places in the model's admission queue (``max_queue``; beyond it 429), and a
hold lasts at most ``queue_timeout_s`` (a coming replica) or ``wake_timeout_s`` (a wake), then 503 naming
what was awaited. A client that hangs up cancels its handler, which gives its place back.

Streams: a held streaming request gets its 200 and ``text/event-stream`` headers after ``stream_after_s``
of holding, then an SSE comment (``: waking model X``) every ``comment_every_s``, so clients and proxies
in between do not time out. Once the stream has begun a later failure (refused, timed out, every attempt
failed) can no longer be a status code: the stream ends with one ``data: {"error": ...}`` event in
OpenAI's error shape, which OpenAI's clients raise as an error.

LoRA adapters (issue 33): a request for an adapter that no replica of its base holds loaded is held as a
cold model's is, and the router asks for it with ``WakeRequest(model=<adapter>)`` (the control plane
loads it on a replica, waking the base if it is at zero). It goes on when a load report lists it loaded
(:meth:`Holding.update`, called by the load report that changed an endpoint's adapters too), and is
refused with the adapter's own error when a replica of its base reports that its load failed, however
the wake stands; at once when its base has nothing ready or coming.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from llmgw_common.catalog import ModelProfile
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_router.dialects.dialect import OPENAI, Dialect
from llmgw_router.errors import CLIENT_GONE, Answer, RouterError, error_body, error_response
from llmgw_router.http.request import Request
from llmgw_router.http.response import Response, StreamResponse
from llmgw_router.metrics import RouterMetrics
from llmgw_router.routing.endpoints import Pool
from llmgw_router.tenancy.admission import Gate
from llmgw_router.tracing import RequestTrace
from llmgw_runtime.runtime import cancel_and_wait

log = logging.getLogger("llmgw.router.holding")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

# Asks the control plane to wake a model: its reply, or None when none came (no responder, timeout,
# NATS away). Given the request, how long to wait for the answer, and the trace context to send with it
# (NATS headers; None when the request is not traced).
WakeAsker = Callable[[WakeRequest, float, dict[str, str] | None], Awaitable[WakeReply | None]]


class Prospect(enum.Enum):
    READY = "ready"  # an endpoint takes requests: go
    COMING = "coming"  # a replica is on its way (the control plane says what): hold
    COLD = "cold"  # scaled to zero: hold and ask for a wake
    NOTHING = "nothing"  # nothing on its way: refuse with the unavailable reason


def prospect(pool: Pool, model: str) -> Prospect:
    """What a request for ``model`` can expect, from the routing endpoints the router holds."""
    if model in pool.ready:
        return Prospect.READY
    adapter = pool.adapters.get(model)
    if adapter is not None:
        # Loaded nowhere: asked for (a replica of its base loads it), unless its load failed or its base
        # has nothing ready or on its way.
        if pool.adapter_error(model) is not None or prospect(pool, adapter.base) is Prospect.NOTHING:
            return Prospect.NOTHING
        return Prospect.COLD
    if model in pool.cold:
        return Prospect.COLD
    if model in pool.coming or not pool.table_read:
        # No table yet: the router started before a control plane led (a cluster coming up). The first
        # table settles the hold; none within queue_timeout_s is a 503 that says so.
        return Prospect.COMING
    return Prospect.NOTHING


@dataclass(slots=True)
class Held:
    """How a hold ended: ``answer`` to give now (a refusal, or a begun stream already ended), or go on
    to admission and the proxy, writing into ``started`` when a held stream has already begun."""

    answer: Answer | None = None
    started: StreamResponse | None = None


class _ModelHolds:
    """The requests held for one model and its wake, if one is being asked for."""

    __slots__ = ("replied_at", "reply", "waiters", "wake")

    def __init__(self) -> None:
        # Each waiter's result: None, an endpoint is ready; a string, the 503 reason.
        self.waiters: set[asyncio.Future[str | None]] = set()
        self.wake: asyncio.Task[None] | None = None
        self.reply: WakeReply | None = None
        # When the reply came (wall clock): a traced request's "wake answered" event is stamped with it.
        self.replied_at = 0.0

    @property
    def waking(self) -> bool:
        """A wake is asked for or under way: holds last until it serves, is refused, or times out."""
        return self.wake is not None or (self.reply is not None and self.reply.state is not WakeState.REFUSED)

    def settle(self, outcome: str | None) -> None:
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(outcome)


class Holding:
    """Every request this router holds, per model; the wakes it asks for."""

    def __init__(
        self, pool: Pool, metrics: RouterMetrics, router_id: str, clock: Callable[[], float]
    ) -> None:
        self.pool, self.metrics, self.router_id, self.clock = pool, metrics, router_id, clock
        self.ask: WakeAsker | None = None
        self.stream_after_s = 2.0
        self.comment_every_s = 5.0
        self.wake_every_s = 3.0
        self.ask_timeout_s = 2.0
        self._models: dict[str, _ModelHolds] = {}
        # Set, and replaced, by each routing update: next_update() waits on it.
        self._updated: asyncio.Event | None = None

    def held(self, model: str) -> int:
        s = self._models.get(model)
        return len(s.waiters) if s is not None else 0

    # ------------------------------------------------------------ the request path

    async def hold(
        self,
        request: Request,
        profile: ModelProfile,
        gate: Gate,
        stream: bool,
        dialect: Dialect = OPENAI,
        model: str | None = None,
        trace: RequestTrace | None = None,
    ) -> Held:
        """Hold a request for a model without a ready endpoint until one appears, or refuse it (a begun
        stream's refusal in its dialect's shape, :meth:`finish`). ``model``: the name asked for when it
        is not ``profile``'s (a LoRA adapter of it). ``trace``: the request's span, told why it was held,
        the wake and how the hold ended."""
        model = model or profile.name
        now = prospect(self.pool, model)
        if now is Prospect.READY:
            return Held()
        state = self._models.get(model)
        failed = self._adapter_failed(model)
        if failed or (now is Prospect.NOTHING and (state is None or not state.waking)):
            return self._refused(model, 503, self.pool.why_unavailable(model, self.clock()), 5)
        if gate.queued + gate.held >= gate.max_queue:
            return self._refused(
                model,
                429,
                f"{self._what(model)} has no ready replica yet and its queue of {gate.max_queue} is full",
                1,
            )
        if state is None:
            state = self._models[model] = _ModelHolds()
        asked = now is Prospect.COLD and state.wake is None and self.ask is not None
        if asked:
            state.wake = asyncio.create_task(self._wake(model, state, trace), name=f"router-wake-{model}")
        waking = now is Prospect.COLD or state.waking
        limit = profile.wake_timeout if waking else profile.queue_timeout_s
        if trace is not None:
            why = "no routing table yet" if not self.pool.table_read else now.value
            what = self.pool.coming.get(model) or ""
            trace.event("llmgw.held", {"llmgw.reason": why, "llmgw.coming": what, "llmgw.limit_s": limit})
            if waking:
                # Asked by this request, or joined to the wake another one asked for.
                trace.event("llmgw.wake.asked", {"llmgw.model": model, "llmgw.wake.joined": not asked})
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str | None] = loop.create_future()
        state.waiters.add(fut)
        gate.held += 1
        # Our own timer on the future, as admission.Gate does (asyncio.wait_for can swallow a cancel).
        timer = loop.call_later(limit, self._expire, fut, model, limit, waking, state)
        t0 = loop.time()
        started: StreamResponse | None = None
        try:
            if stream:
                started, gone = await self._wait_streaming(request, fut, model, waking)
                if gone:
                    # A held stream's comment could not be written: the client has gone.
                    self.metrics.request(model, CLIENT_GONE, loop.time() - t0)
                    return Held(answer=started)
            else:
                await fut
        except asyncio.CancelledError:
            # The client hung up (aiohttp cancels its handler): counted as 499, like a proxied one.
            self.metrics.request(model, CLIENT_GONE, loop.time() - t0)
            raise
        finally:
            timer.cancel()
            state.waiters.discard(fut)
            gate.held -= 1
            self.metrics.hold(model, loop.time() - t0)
            self._forget_if_done(model, state)
        problem = fut.result()
        if trace is not None:
            self._trace_end(trace, state, waking, problem, loop.time() - t0)
        if problem is None:
            return Held(started=started)
        if started is None:
            return self._refused(model, 503, problem, 5, loop.time() - t0)
        self.metrics.request(model, 503, loop.time() - t0)
        return Held(answer=await self.finish(started, error_response(503, problem), dialect))

    async def finish(
        self, started: StreamResponse, answer: Answer, dialect: Dialect = OPENAI
    ) -> StreamResponse:
        """The client's answer when a held stream had begun before ``answer`` was made: ``answer`` itself
        if the proxy wrote into the begun stream, else its body as the stream's last SSE event, as the
        dialect ends a stream (Anthropic's clients read a failure as an ``event: error`` in its own
        shape, and its streams have no ``[DONE]``)."""
        if answer is started:
            return started
        if isinstance(answer, RouterError):
            data = dialect.held_error(answer)
        elif isinstance(answer, Response):
            data = answer.body
        else:
            data = error_body(502, "the answer could not be relayed")
        event = dialect.held_end(data, answer.status)
        try:
            await started.write_eof(event)
        except ConnectionResetError:
            pass  # the client went away: nothing more to tell it
        return started

    # ------------------------------------------------------------ events

    async def next_endpoints(self, version: int, timeout: float) -> bool:
        """Wait, at most ``timeout``, for routing endpoints other than those of ``version``; whether
        they came."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while self.pool.endpoints_version == version:
            left = until - loop.time()
            if left <= 0:
                return False
            if self._updated is None:
                self._updated = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._updated.wait(), left)
        return True

    def update(self) -> None:
        """After a routing update: release the holds whose model has an endpoint now; refuse those for
        which nothing is coming any more (a wake asked for keeps its holds until it ends)."""
        ev, self._updated = self._updated, None
        if ev is not None:
            ev.set()
        for model, state in list(self._models.items()):
            now = prospect(self.pool, model)
            if now is Prospect.READY:
                state.settle(None)
            elif now is Prospect.NOTHING and (not state.waking or self._adapter_failed(model)):
                # An adapter whose load failed is refused whatever its wake says: no load is coming.
                state.settle(self.pool.why_unavailable(model, self.clock()))

    async def close(self) -> None:
        """Cancel the wakes being asked for (on the router's stop)."""
        # Not one cancel: a wake's nc.request can swallow it (see cancel_and_wait).
        await cancel_and_wait([s.wake for s in self._models.values() if s.wake is not None])

    # ------------------------------------------------------------ internals

    @staticmethod
    def _trace_end(
        trace: RequestTrace, state: _ModelHolds, waking: bool, problem: str | None, seconds: float
    ) -> None:
        reply = state.reply
        if reply is not None:
            attrs = {"llmgw.wake.state": reply.state.value, "llmgw.reason": reply.reason}
            trace.event("llmgw.wake.answered", attrs, at=state.replied_at)
        if waking and problem is None:
            trace.event("llmgw.wake.served", {"llmgw.held_s": seconds})
        outcome = "ready" if problem is None else problem
        trace.event("llmgw.hold.ended", {"llmgw.held_s": seconds, "llmgw.outcome": outcome})

    def _adapter_failed(self, model: str) -> bool:
        return model in self.pool.adapters and self.pool.adapter_error(model) is not None

    def _what(self, model: str) -> str:
        """The name asked for, in the user's terms."""
        a = self.pool.adapters.get(model)
        return f"adapter {model!r} (of model {a.base!r})" if a is not None else f"model {model!r}"

    def _refused(
        self, model: str, status: int, message: str, retry_after: int, seconds: float | None = None
    ) -> Held:
        self.metrics.request(model, status, seconds)
        return Held(answer=error_response(status, message, retry_after=retry_after))

    async def _wait_streaming(
        self, request: Request, fut: asyncio.Future[str | None], model: str, waking: bool
    ) -> tuple[StreamResponse | None, bool]:
        """Wait for ``fut``; past ``stream_after_s`` begin the answer and send SSE comments. Returns the
        begun answer (None if it was not begun) and whether the client has gone."""
        if model in self.pool.adapters:
            comment = f": loading adapter {model}\n\n".encode()
        else:
            comment = f": {'waking' if waking else 'waiting for'} model {model}\n\n".encode()
        started: StreamResponse | None = None
        delay = self.stream_after_s
        while True:
            await asyncio.wait((fut,), timeout=delay)
            if fut.done():
                return started, False
            try:
                if started is None:
                    started = StreamResponse(status=200, headers=SSE_HEADERS)
                    await started.prepare(request)
                await started.write(comment)
            except ConnectionResetError:
                return started, True
            delay = self.comment_every_s

    def _expire(
        self, fut: asyncio.Future[str | None], model: str, limit: float, waking: bool, state: _ModelHolds
    ) -> None:
        if fut.done():
            return
        what = self.pool.coming.get(model)
        adapter = self.pool.adapters.get(model)
        if adapter is not None and self.pool.table_read:
            base = self.pool.coming.get(adapter.base)
            if state.reply is None:
                problem = (
                    f"{self._what(model)} is not loaded and the control plane did not answer the request "
                    f"to load it within {limit:g}s"
                )
            else:
                problem = f"{self._what(model)} was not loaded within {limit:g}s" + (
                    f" ({base})" if base else ""
                )
        elif not self.pool.table_read:
            problem = f"model {model!r} has no ready replica: no control plane published a routing table within {limit:g}s"
        elif waking:
            if state.reply is None:
                problem = (
                    f"model {model!r} is scaled to zero and the control plane did not answer the wake "
                    f"request within {limit:g}s"
                )
            else:
                problem = f"model {model!r} did not wake within {limit:g}s" + (f" ({what})" if what else "")
        else:
            problem = f"model {model!r} has no ready replica: {what or 'a replica'} did not become ready within {limit:g}s"
        fut.set_result(problem)

    async def _wake(self, model: str, state: _ModelHolds, trace: RequestTrace | None) -> None:
        """Ask for a wake, one request in flight, again every ``wake_every_s`` while requests are held.
        ``trace``: the request that asked first; each ask is a span of its trace, its context in the
        NATS headers (the control plane's own span of the wake goes under it)."""
        assert self.ask is not None
        log.info(
            "asking the control plane to wake %s (%d requests held)", self._what(model), len(state.waiters)
        )
        try:
            while state.waiters:
                req = WakeRequest(model=model, router=self.router_id, sent_at=self.clock())
                if trace is None:
                    reply = await self.ask(req, self.ask_timeout_s, None)
                else:
                    span, reply = trace.wake(model), None
                    try:
                        reply = await self.ask(req, self.ask_timeout_s, span.headers)
                    finally:
                        span.end(None if reply is None else reply.state.value)
                if reply is None:
                    log.debug("no answer to the wake request for %s; asking again", model)
                else:
                    state.reply, state.replied_at = reply, time.time()
                    if reply.state is WakeState.REFUSED:
                        why = reply.reason or "the control plane refused"
                        if model in self.pool.adapters:
                            state.settle(f"{self._what(model)} cannot be loaded: {why}")
                        else:
                            state.settle(f"model {model!r} cannot be woken: {why}")
                        return
                await asyncio.sleep(self.wake_every_s)
        finally:
            state.wake = None
            self._forget_if_done(model, state)

    def _forget_if_done(self, model: str, state: _ModelHolds) -> None:
        # A later burst starts afresh (a new wake, no stale reply).
        if not state.waiters and state.wake is None and self._models.get(model) is state:
            del self._models[model]
