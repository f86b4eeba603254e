"""The router's wiring: what a request needs, built once per router and passed in (no module-level
state). Behaviour lives in the rooms; this only joins them."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

from llmgw_router.cache.router import PrefixRouting
from llmgw_router.holding import Holding
from llmgw_router.idle import IdleMap
from llmgw_router.metrics import RouterMetrics
from llmgw_router.routing.endpoints import Pool
from llmgw_router.routing.pick import Choosing
from llmgw_router.tenancy.admission import Gates
from llmgw_router.tenancy.auth import Exemptions
from llmgw_router.tenancy.keycheck import KeyCheck
from llmgw_router.tenancy.keys import KeyTable
from llmgw_router.tenancy.quota import Quotas
from llmgw_router.tenancy.usage import UsageTable
from llmgw_router.tracing import RouterTracing
from llmgw_router.upstream.client import UpstreamClient


@dataclass(slots=True)
class Limits:
    max_body_bytes: int = 8 * 1024 * 1024
    retries: int = 2
    max_migrations: int = 2
    load_stale_s: float = 5.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    stream_stall_s: float = 60.0
    withdrawn_silence_s: float = 2.0
    refused_wait_s: float = 10.0
    body_timeout_s: float = 60.0
    prefix_affinity: bool = False
    prefix_load_factor: float = 1.25
    # The report tick: quota shares are recomputed on it, and a peer's use extrapolated over it.
    tick_s: float = 1.0


@dataclass(eq=False)
class RouterContext:
    """The collaborators a request's handling is given. ``auth``, ``exemptions`` and ``rng`` go into
    them (the key check, the endpoint choice) and are not kept apart."""

    router_id: str
    pool: Pool
    keys: KeyTable
    auth: InitVar[bool]
    exemptions: InitVar[Exemptions]
    limits: Limits
    started: float
    clock: Callable[[], float] = time.time
    rng: InitVar[random.Random | None] = None
    upstream: UpstreamClient | None = None
    gates: Gates = field(default_factory=Gates)
    choosing: Choosing = field(init=False)
    idle: IdleMap = field(init=False)
    usage: UsageTable = field(init=False)
    metrics: RouterMetrics = field(init=False)
    holding: Holding = field(init=False)
    quota: Quotas = field(init=False)
    keycheck: KeyCheck = field(init=False)
    # Routing by cached prefix (cache/), once the bus is reached; None in static mode.
    cache: PrefixRouting | None = None
    # OpenTelemetry spans (tracing.py); None, the default, when no OTLP endpoint is configured.
    tracing: RouterTracing | None = None

    def __post_init__(self, auth: bool, exemptions: Exemptions, rng: random.Random | None) -> None:
        lim = self.limits
        self.choosing = Choosing(lim.load_stale_s, lim.prefix_load_factor, rng or random.Random())
        self.idle = IdleMap(self.started)
        # The clock read through ctx at each call: a test may set ctx.clock after construction.
        self.keycheck = KeyCheck(self.keys, auth, exemptions, lambda: self.clock())
        self.quota = Quotas(self.keys, self.router_id, lim.tick_s)
        self.usage = UsageTable(self.started, self.quota, lambda: self.clock())
        self.metrics = RouterMetrics(self.pool, self.gates.by_model)
        self.holding = Holding(self.pool, self.metrics, self.router_id, self.clock)
