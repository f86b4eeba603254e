"""Wake requests (issue 13): a router holds a request for a model with no replica and asks the leading
control plane, on ``<prefix>.router.<id>.wake``, to bring one. What to answer and what is remembered of
the wakes are decided in :mod:`wake_decisions` (pure); this is the I/O.

:class:`WakeResponder`: subscribed only while this process leads (a standby never answers), it answers,
records the wake and wakes the reconcile loop. One model's answer is reused for a second while the
tables are unchanged: a flood of wakes costs one placement search per model, not one per message.

A wake asked by a traced request carries its trace context in the NATS headers (``traceparent``,
docs/tracing.md): the answer is logged with the trace id, and is a span of that trace when this
control plane exports spans (``tracer``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from llmgw_common.codec import encode
from llmgw_common.names import check_model_name, clipped
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_common.traceparent import TraceParent, parse_traceparent
from llmgw_runtime import bus
from llmgw_runtime.tracing import Tracer

log = logging.getLogger("llmgw.controlplane.wakes")


# One model's answer is reused this long while the control plane's tables (``version``) are unchanged.
# An answer for a model that does not fit searches placements: ~80 ms on 64 nodes of 8 cards
# (a catalog of 512 one-card models, all resident and evictable, and one 8-card model woken). Computed
# per message, a few dozen wakes a second (routers re-asking, or any process with the router role)
# would hold the event loop, lease renewal and reconcile pass included; reused, a flood costs one
# search per model per interval.
ANSWER_REUSE_S = 1.0
# Answers kept at most (then all are dropped): wakes for invented model names must not grow memory.
MEMO_MAX = 1024


class WakeResponder:
    """Answers wake requests while this process leads. ``answer(request)`` is the control plane's (it
    reads its tables and records the wake); ``version()`` changes whenever those tables do."""

    def __init__(
        self,
        subject: str,
        answer: Callable[[WakeRequest], WakeReply],
        drops: bus.DropLog,
        *,
        version: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
        reuse_s: float = ANSWER_REUSE_S,
        tracer: Tracer | None = None,
    ) -> None:
        self.subject = subject
        self.answer = answer
        self.drops = drops
        self.version = version
        self.clock = clock
        self.reuse_s = reuse_s
        self.tracer = tracer
        self._sub: Subscription | None = None
        # model -> (tables' version, when computed, the answer)
        self._memo: dict[str, tuple[int, float, WakeReply]] = {}
        self.answered = 0

    async def start(self, nc: NATS) -> None:
        if self._sub is None:
            self._sub = await bus.subscribe(nc, self.subject, WakeRequest, self._on_wake, self.drops)
            await bus.flush(nc)

    async def stop(self) -> None:
        self._memo.clear()  # a later tenure answers from its own tables
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error as e:
                log.debug("wake responder stop: %s", e)

    def _reply(self, req: WakeRequest) -> WakeReply:
        """The answer for ``req.model``: the one computed last while the tables are unchanged and it is
        recent, else a new one (which the control plane records: a reused ``waking`` was recorded)."""
        try:
            check_model_name(req.model)
        except ValueError as e:
            # No catalog has it. Echoed in full, a name near the payload limit makes the reply too big
            # to send (the router would wait out its timeout), and would be kept in the memo.
            return WakeReply(
                model=clipped(req.model, 100), state=WakeState.REFUSED, reason=f"not a model name: {e}"
            )
        version, now = self.version(), self.clock()
        hit = self._memo.get(req.model)
        if hit is not None and hit[0] == version and now - hit[1] < self.reuse_s:
            return hit[2]
        reply = self.answer(req)
        if len(self._memo) >= MEMO_MAX:
            self._memo.clear()
        # The version after: computing it took a snapshot, which may have counted pending changes.
        self._memo[req.model] = (self.version(), now, reply)
        return reply

    def _traced(self, req: WakeRequest, reply: WakeReply, parent: TraceParent, start_ns: int) -> None:
        """A wake asked by a traced request: the answer logged with its trace id, and a span of the trace."""
        log.info(
            "wake of %s asked by router %s answered %s (trace %032x)",
            req.model,
            req.router,
            reply.state.value,
            parent.trace_id,
        )
        if self.tracer is None:
            return
        from opentelemetry.trace import SpanKind

        span = self.tracer.start(
            f"wake {clipped(req.model, 100)}", SpanKind.SERVER, parent, start_ns=start_ns
        )
        if span.is_recording():
            span.set_attributes(
                {
                    "messaging.system": "nats",
                    "llmgw.model": clipped(req.model, 100),
                    "llmgw.router": req.router,
                    "llmgw.wake.state": reply.state.value,
                    "llmgw.reason": reply.reason,
                }
            )
        span.end()

    async def _on_wake(self, req: WakeRequest, msg: Msg) -> None:
        parts = msg.subject.split(".")
        if len(parts) < 2 or parts[-2] != req.router:
            # Permissions are per subject: only the subject's router is believed.
            self.drops.drop(msg.subject, f"claims router {req.router!r}, not the subject's")
            return
        if not msg.reply:
            return
        parent = parse_traceparent(msg.headers.get("traceparent")) if msg.headers else None
        start_ns = time.time_ns()
        reply = self._reply(req)
        self.answered += 1
        if parent is not None:
            self._traced(req, reply, parent, start_ns)
        try:
            await msg.respond(encode(reply))
        except nats.errors.Error as e:
            log.warning("could not answer a wake for %s: %s", req.model, e)
