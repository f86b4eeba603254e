"""Client connections: a cap on how many the router holds, and deadlines on each one.

Without them a client that connects and sends half a request line, or nothing, holds a file
descriptor for ever, and 20,000 of them exhaust the process's descriptors (then nobody is served, and
the upstream side cannot connect either). The connections are ``connection.Connection`` objects; the
server's sweep (a few times per timeout) calls :meth:`ConnectionGuard.sweep`:

- **header deadline**: from the connection's start, and from the first byte of each later request,
  until its headers are complete.
- **write deadline**: a connection whose writes have waited for room (the transport paused writing:
  the client reads nothing) for ``write_timeout_s`` is aborted, which ends its handler, its upstream
  request and the engine's work. The pause and resume callbacks cost nothing until a client stalls.
- **cap**: at ``max_connections``, a new connection takes the place of the connection idle the longest
  (no request, half a request's headers, or a kept-alive connection between requests), else of the one
  whose client has read nothing for the longest (its writes wait for room: it would hold its place
  until the write deadline, and clients that never read could hold every place); when every held
  connection is busy with a request and reading, the new one gets a 503 and is closed. Descriptors
  stay bounded by the cap either way, and a normal client still gets in while idle or stalled
  connections fill the cap. Finding the one to close takes no scan of the held connections: idle
  ones are queued as they become idle (an entry is stale once its connection is busy again or gone,
  and skipped), stalled ones are kept in the order they stalled.

The idle (keep-alive) deadline is the server's; the body deadline is the handler's (``body_timeout_s``,
a 408 while a response is still possible): only a handler knows whether it reads the body.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import resource
import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("llmgw.router.connections")

# Log the cap being reached at most this often (a flood must not become a log flood).
_LOG_EVERY_S = 60.0


# Descriptors kept for everything that is not a client connection: listeners, NATS, logs, the loop.
_FD_RESERVE = 64


def cap_for_fd_limit(max_connections: int, nofile: int) -> int:
    """The connection cap that fits the process's descriptor limit.

    Each client connection can need a second descriptor for its upstream connection, so the cap is at
    most half of what is left after a reserve; a cap above that would let clients exhaust descriptors
    before the cap is reached.
    """
    return max(1, min(max_connections, (nofile - _FD_RESERVE) // 2))


def fit_to_fd_limit(max_connections: int) -> int:
    """Raise the soft descriptor limit to the hard one if needed, and return the cap that fits it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
    cap = max_connections if soft == resource.RLIM_INFINITY else cap_for_fd_limit(max_connections, soft)
    if cap < max_connections:
        log.warning(
            "max_connections %d lowered to %d: the descriptor limit is %d (ulimit -n); "
            "each client connection can need two",
            max_connections,
            cap,
            soft,
        )
    return cap


class Guarded(Protocol):
    """What the guard needs of a connection (``connection.Connection``)."""

    deadline: float | None
    since: float
    write_paused_at: float | None

    def idle(self) -> bool: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


class ConnectionGuard:
    """The router's client connections: the count, the cap, the header deadlines."""

    def __init__(self, max_connections: int, header_timeout_s: float, write_timeout_s: float = 60.0) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.write_timeout_s = write_timeout_s
        self._held: set[Guarded] = set()
        # (connection, its ``since`` then) as connections become idle, oldest first; an entry whose
        # connection has since become busy, idle again (a newer entry) or gone is stale.
        self._idle: collections.deque[tuple[Guarded, float]] = collections.deque()
        # Connections whose writes wait for room (the client reads nothing), in the order they stalled.
        self._stalled: dict[Guarded, None] = {}
        self.evicted = 0
        self.evicted_stalled = 0
        self.refused = 0
        self.timed_out = 0
        self.write_timed_out = 0
        self._logged = float("-inf")

    @property
    def count(self) -> int:
        return len(self._held)

    def admit(self, conn: Guarded) -> bool:
        if len(self._held) >= self.max_connections:
            victim = self._longest_idle()
            if victim is not None:
                self.evicted += 1
                self._note_full("closing the connection idle the longest for each new one")
            elif self._stalled:
                victim = next(iter(self._stalled))
                self.evicted_stalled += 1
                self._note_full("closing the connection whose client has read nothing the longest")
            else:
                self.refused += 1
                self._note_full("refusing new connections: every one held is busy with a request")
                return False
            self.forget(victim)
            victim.close()
        self._held.add(conn)
        return True

    def became_idle(self, conn: Guarded) -> None:
        """``conn`` is idle from its ``since`` (new, or its answer is out with nothing else to do).

        Only an append: the stale entries are dropped by the sweep (``compact``)."""
        self._idle.append((conn, conn.since))

    def compact(self) -> None:
        """Drop the idle queue's stale entries, which would keep closed connections alive (called by the
        sweep, a few times a second: the queue holds at most the entries of that long, over the live)."""
        q, held = self._idle, self._held
        if len(q) > 2 * len(held) + 64:
            self._idle = collections.deque(
                e for e in q if e[0] in held and e[0].since == e[1] and e[0].idle()
            )

    def stalled(self, conn: Guarded) -> None:
        self._stalled[conn] = None

    def unstalled(self, conn: Guarded) -> None:
        self._stalled.pop(conn, None)

    def forget(self, conn: Guarded) -> None:
        self._held.discard(conn)
        self._stalled.pop(conn, None)

    def _longest_idle(self) -> Guarded | None:
        q, held = self._idle, self._held
        while q:
            c, since = q.popleft()
            if c.since == since and c in held and c.idle():
                return c
        return None

    def _note_full(self, what: str) -> None:
        now = time.monotonic()
        if now - self._logged >= _LOG_EVERY_S:
            self._logged = now
            log.warning(
                "%d client connections (max_connections): %s (so far: %d closed, %d refused)",
                len(self._held),
                what,
                self.evicted,
                self.refused,
            )

    def sweep(self, now: float) -> None:
        """Close connections whose request headers are late, or whose client has stopped reading."""
        self.compact()
        late = [c for c in self._held if c.deadline is not None and now >= c.deadline]
        for c in late:
            self.timed_out += 1
            self.forget(c)
            c.close()
        stuck = []
        for c in self._stalled:  # in the order they stalled: the first still in time ends the look
            paused = c.write_paused_at
            if paused is None:
                continue
            if now - paused < self.write_timeout_s:
                break
            stuck.append(c)
        for c in stuck:
            self.write_timed_out += 1
            self.forget(c)
            c.abort()


class ConnectionMetrics(Collector):
    """The guard's counts on the router's /metrics, read at scrape time."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        g = self.guard
        held = GaugeMetricFamily("llmgw_router_connections", "Client connections held now")
        held.add_metric([], g.count)
        yield held
        closed = CounterMetricFamily(
            "llmgw_router_connections_closed",
            "Client connections the router closed or refused: header_timeout, write_timeout (the "
            "client read nothing), evicted (idle, to make room at max_connections), evicted_stalled "
            "(its client read nothing, to make room at max_connections), refused "
            "(max_connections, all busy)",
            labels=["reason"],
        )
        closed.add_metric(["header_timeout"], g.timed_out)
        closed.add_metric(["write_timeout"], g.write_timed_out)
        closed.add_metric(["evicted"], g.evicted)
        closed.add_metric(["evicted_stalled"], g.evicted_stalled)
        closed.add_metric(["refused"], g.refused)
        yield closed
