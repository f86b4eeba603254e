"""Mid-stream failover, the I/O part: continue a stream that broke after its first byte on another endpoint.

:class:`Migration` rides along one streamed request: it relays the engine's bytes by whole events
(:class:`llmgw_router.failover.relay.Relay`) and, when the stream breaks, :meth:`Migration.resume` asks other
endpoints for the rest (:func:`llmgw_router.failover.continuation.plan`) and writes it to the client's response, up
to ``max_migrations`` times per request. Counted in ``llmgw_router_migrations_total{model,outcome}``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from llmgw_common.catalog import ModelProfile
from llmgw_router.context import RouterContext
from llmgw_router.errors import CLIENT_GONE
from llmgw_router.failover.continuation import KINDS, Close, Kind, Refuse, plan, request_blocker
from llmgw_router.failover.relay import Relay, Unframed
from llmgw_router.http.response import StreamResponse
from llmgw_router.routing.endpoints import EndpointState
from llmgw_router.routing.pick import pick
from llmgw_router.upstream.connection import UpstreamError

log = logging.getLogger("llmgw.router.migration")


class Migration:
    """The failover state of one streamed request."""

    __slots__ = ("_path", "kind", "model", "off", "relay", "req", "tried")

    def __init__(self, kind: Kind, path: str, model: str, req: dict[str, Any], off: str) -> None:
        self.kind, self._path, self.model, self.req = kind, path, model, req
        # Why this request's stream will not be continued ("" when it will): the metric's outcome.
        self.off = off
        self.relay = Relay()
        self.tried: list[EndpointState] = []

    @classmethod
    def of(
        cls, ctx: RouterContext, path: str, req: dict[str, Any] | None, profile: ModelProfile | None
    ) -> Migration | None:
        """A migration for a streamed chat or completion request; None for anything else."""
        kind = KINDS.get(path)
        if kind is None or req is None or req.get("stream") is not True:
            return None
        model = req["model"]
        if (profile is not None and not profile.failover) or ctx.limits.max_migrations == 0:
            return cls(kind, path, model, req, "off")
        return cls(kind, path, model, req, "unsupported" if request_blocker(kind, req) else "")

    def relay_bytes(self, data: bytes) -> bytes:
        """What of an engine's bytes to send the client now (whole events only, unless never resumed)."""
        return data if self.off else self.relay.relay(data)

    def complete(self) -> bool:
        """The stream being relayed ended as a stream should, with ``[DONE]``."""
        return bool(self.off) or self.relay.ended or self.relay.through

    async def resume(self, ctx: RouterContext, resp: StreamResponse, why: str) -> int:
        """Continue the broken stream into ``resp``; the status to record (200, 502, or 499)."""
        if self.off:
            ctx.metrics.migration(self.model, self.off)
            log.warning(
                "stream of %s broke after the first byte (%s); failover %s", self.model, why, self.off
            )
            return 502
        assert ctx.upstream is not None
        for n in range(ctx.limits.max_migrations):
            step = plan(self.kind, self.req, self.relay.fold())
            if isinstance(step, Refuse):
                ctx.metrics.migration(self.model, "unsupported")
                log.warning(
                    "stream of %s broke (%s) and cannot be continued: %s", self.model, why, step.reason
                )
                return 502
            if isinstance(step, Close):
                return await self._close(ctx, resp, step.tail)
            ep = pick(ctx.pool, ctx.choosing, self.model, self.tried, ctx.clock())
            if ep is None:
                break
            self.tried.append(ep)
            log.info(
                "stream of %s broke (%s): continuing on %s (migration %d)",
                self.model,
                why,
                ep.replica_id,
                n + 1,
            )
            ep.in_flight += 1
            verdict: bool | None = None
            told = False  # the breaker has heard the verdict already
            up = None
            try:
                up = await ctx.upstream.post(ep.url, self._path, step.body, held=ep.answers)
                ep.answers.add(up)
                if up.status != 200:
                    verdict = up.status < 500
                    why = f"{ep.replica_id} answered {up.status} to the continuation"
                    continue
                self.relay.splice()
                while True:
                    data = await up.readany()
                    if verdict is None:
                        verdict = told = True
                        ep.breaker.success()  # as in proxy._stream: the endpoint answers
                    out = self.relay.relay(data)
                    # At its [DONE] the client's stream ends, whether or not the engine closes.
                    if self.relay.ended or not data or up.at_eof():
                        if not self.relay.ended:
                            raise _Incomplete(f"{ep.replica_id}: the continuation ended without [DONE]")
                        await resp.write_eof(out)
                        ctx.metrics.migration(self.model, "ok")
                        return 200
                    if out:
                        await resp.write(out)
            except (UpstreamError, _Incomplete, Unframed) as e:
                verdict = False
                why = str(e)
            except ConnectionResetError:
                return CLIENT_GONE
            finally:
                ep.in_flight -= 1
                if up is not None:
                    ep.answers.discard(up)
                    up.close()
                if verdict is False:
                    ep.breaker.failure(ctx.clock())
                elif verdict is None:
                    ep.breaker.abandon()
                elif not told:
                    ep.breaker.success()
        ctx.metrics.migration(self.model, "failed")
        log.warning("stream of %s broke and no replica continued it: %s", self.model, why)
        return 502

    async def _close(self, ctx: RouterContext, resp: StreamResponse, tail: bytes) -> int:
        try:
            await resp.write_eof(tail)
        except ConnectionResetError:
            return CLIENT_GONE
        ctx.metrics.migration(self.model, "ok")
        return 200


def abort_withdrawn(gone: Iterable[EndpointState], silence_s: float) -> int:
    """Give up on the answers in flight to endpoints the routing table withdrew, each once its engine has
    been silent for ``silence_s``; how many were in flight.

    The control plane withdraws an endpoint when its node is lost or its replica failed or stopped. A
    node that vanished without closing its connections (power loss, a partition, a frozen engine) would
    otherwise hold its streams until a read times out. Each aborted read raises ``Aborted``: a stream
    is continued on another endpoint (a migration), an answer not yet started is retried. An engine
    still sending is let finish: a node cut off from the bus is withdrawn, yet may still answer us. An
    attempt that picked the endpoint before it left and reaches it after is given up the same way
    (:class:`upstream_connection.Answers`).
    """
    n = 0
    for ep in gone:
        held = ep.answers.withdraw(f"{ep.replica_id} was withdrawn from the routing table", silence_s)
        if held:
            log.warning(
                "%s (%s) withdrawn with %d answers in flight: each given up after %gs of silence",
                ep.replica_id,
                ep.url,
                held,
                silence_s,
            )
        n += held
    return n


class _Incomplete(Exception):
    """A stream that ended cleanly at the HTTP level but without its ``[DONE]``."""
