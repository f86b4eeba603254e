"""Everything a request needs, built once per router and passed in (no module-level state)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw_common.catalog import ModelProfile
from llmgw_router.holding import Holding
from llmgw_router.idle import IdleMap
from llmgw_router.metrics import RouterMetrics
from llmgw_router.routing.endpoints import Pool
from llmgw_router.routing.pick import Choosing
from llmgw_router.tenancy.admission import Gate
from llmgw_router.tenancy.auth import Exemptions
from llmgw_router.tenancy.keys import KeyTable
from llmgw_router.tenancy.quota import Quotas
from llmgw_router.tenancy.usage import UsageTable
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
    router_id: str
    pool: Pool
    keys: KeyTable
    auth: bool
    exemptions: Exemptions
    limits: Limits
    started: float
    clock: Callable[[], float] = time.time
    rng: random.Random = field(default_factory=random.Random)
    gates: dict[str, Gate] = field(default_factory=dict)
    in_flight: int = 0
    upstream: UpstreamClient | None = None
    idle: IdleMap = field(init=False)
    usage: UsageTable = field(init=False)
    metrics: RouterMetrics = field(init=False)
    holding: Holding = field(init=False)
    quota: Quotas = field(init=False)
    choosing: Choosing = field(init=False)

    def __post_init__(self) -> None:
        self.idle = IdleMap(self.started)
        self.choosing = Choosing(self.limits.load_stale_s, self.limits.prefix_load_factor, self.rng)
        self.quota = Quotas(self.keys, self.router_id, self.limits.tick_s)
        # The clock read through ctx at each call: a test may set ctx.clock after construction.
        self.usage = UsageTable(self.started, self.quota, lambda: self.clock())
        self.metrics = RouterMetrics(self.pool, self.gates, lambda: self.in_flight)
        self.holding = Holding(self.pool, self.metrics, self.router_id, self.clock)

    def gate(self, profile: ModelProfile) -> Gate:
        g = self.gates.get(profile.name)
        if g is None:
            g = self.gates[profile.name] = Gate(
                profile.name, profile.max_concurrency, profile.max_queue, profile.queue_timeout_s
            )
        return g

    def refresh_gates(self) -> None:
        """Apply the catalog's admission settings to existing gates (after a catalog update)."""
        for name, g in self.gates.items():
            p = self.pool.profiles.get(name)
            if p is not None:
                g.configure(p.max_concurrency, p.max_queue, p.queue_timeout_s)

    def new_upstream(self) -> UpstreamClient:
        lim = self.limits
        return UpstreamClient(lim.connect_timeout_s, lim.read_timeout_s, stall_timeout_s=lim.stream_stall_s)
