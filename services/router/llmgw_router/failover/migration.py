"""Mid-stream failover, the I/O part: a stream that broke after its first byte, continued on another
endpoint.

:class:`Migration` rides along one streamed request: it relays the engine's bytes by whole events
(:class:`llmgw_router.failover.relay.Relay`) and says what the continuation asks
(:meth:`Migration.plan`, :func:`llmgw_router.failover.continuation.plan`); :func:`continue_on` sends it to
one endpoint and writes the rest into the client's response. Which endpoints, how many times
(``max_migrations``) and what is counted are the request path's one loop (``proxy.py``). Counted in
``llmgw_router_migrations_total{model,outcome}``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from typing import Any

from llmgw_common.catalog import ModelProfile
from llmgw_router.failover.continuation import Close, Continue, Kind, Refuse, plan, request_blocker
from llmgw_router.failover.relay import Relay, Unframed
from llmgw_router.http.response import StreamResponse
from llmgw_router.routing.endpoints import EndpointState
from llmgw_router.upstream.client import UpstreamClient
from llmgw_router.upstream.connection import UpstreamError

log = logging.getLogger("llmgw.router.migration")


class Barred(enum.Enum):
    """Why a stream will not be continued: the metric's outcome when it breaks."""

    OFF = "off"  # the model's catalog entry says failover: false, or max_migrations is 0
    UNSUPPORTED = "unsupported"  # the request cannot be continued, whatever is sent (request_blocker)


class Migration:
    """The failover state of one streamed request."""

    __slots__ = ("barred", "kind", "model", "relay", "req")

    def __init__(self, kind: Kind, model: str, req: dict[str, Any], barred: Barred | None) -> None:
        self.kind, self.model, self.req = kind, model, req
        self.barred = barred
        self.relay = Relay()

    @classmethod
    def of(
        cls,
        kind: Kind | None,
        req: dict[str, Any] | None,
        profile: ModelProfile | None,
        max_migrations: int,
    ) -> Migration | None:
        """A migration for a streamed request of a dialect whose streams are continued; None else."""
        if kind is None or req is None or req.get("stream") is not True:
            return None
        model = req["model"]
        if (profile is not None and not profile.failover) or max_migrations == 0:
            return cls(kind, model, req, Barred.OFF)
        return cls(kind, model, req, Barred.UNSUPPORTED if request_blocker(kind, req) else None)

    def relay_bytes(self, data: bytes) -> bytes:
        """What of an engine's bytes to send the client now (whole events only, unless never resumed)."""
        return data if self.barred is not None else self.relay.relay(data)

    def complete(self) -> bool:
        """The stream being relayed ended as a stream should, with ``[DONE]``."""
        return self.barred is not None or self.relay.ended or self.relay.through

    def plan(self) -> Continue | Close | Refuse:
        """What continues the stream from what the client has been sent."""
        return plan(self.kind, self.req, self.relay.fold())


async def continue_on(
    upstream: UpstreamClient,
    ep: EndpointState,
    path: str,
    body: bytes,
    mig: Migration,
    resp: StreamResponse,
    clock: Callable[[], float],
    extra: bytes = b"",
) -> bool | str:
    """Ask ``ep`` for the rest of the broken stream and write it into ``resp``: True when the client's
    stream ended whole, False when the client went away, else why this endpoint failed. ``extra``: header
    lines for the engine (the trace context)."""
    ep.in_flight += 1
    verdict: bool | None = None
    told = False  # the breaker has heard the verdict already
    up = None
    relay = mig.relay
    try:
        up = await upstream.post(ep.url, path, body, held=ep.answers, extra=extra)
        ep.answers.add(up)
        if up.status != 200:
            verdict = up.status < 500
            return f"{ep.replica_id} answered {up.status} to the continuation"
        relay.splice()
        while True:
            data = await up.readany()
            if verdict is None:
                verdict = told = True
                ep.breaker.success()  # as for a first answer: the endpoint answers
            out = relay.relay(data)
            # At its [DONE] the client's stream ends, whether or not the engine closes.
            if relay.ended or not data or up.at_eof():
                if not relay.ended:
                    raise _Incomplete(f"{ep.replica_id}: the continuation ended without [DONE]")
                await resp.write_eof(out)
                return True
            if out:
                await resp.write(out)
    except (UpstreamError, _Incomplete, Unframed) as e:
        verdict = False
        return str(e)
    except ConnectionResetError:
        return False
    finally:
        ep.in_flight -= 1
        if up is not None:
            ep.answers.discard(up)
            up.close()
        if verdict is False:
            ep.breaker.failure(clock())
        elif verdict is None:
            ep.breaker.abandon()
        elif not told:
            ep.breaker.success()


async def close_with(resp: StreamResponse, tail: bytes) -> bool:
    """End the client's stream with ``tail`` (a continuation that needs no engine); False if it left."""
    try:
        await resp.write_eof(tail)
    except ConnectionResetError:
        return False
    return True


def abort_withdrawn(gone: Iterable[EndpointState], silence_s: float) -> int:
    """Give up on the answers in flight to endpoints the routing table withdrew, each once its engine has
    been silent for ``silence_s``; how many were in flight.

    The control plane withdraws an endpoint when its node is lost or its replica failed or stopped. A
    node that vanished without closing its connections (power loss, a partition, a frozen engine) would
    otherwise hold its streams until a read times out. Each aborted read raises ``Aborted``: a stream
    is continued on another endpoint (a migration), an answer not yet started is retried. An engine
    still sending is let finish: a node cut off from the bus is withdrawn, yet may still answer us. An
    attempt that picked the endpoint before it left and reaches it after is given up the same way
    (:class:`upstream.connection.Answers`).
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
