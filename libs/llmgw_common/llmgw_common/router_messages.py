"""Typed messages routers send: their per-tick reports to the control plane and to each other (idle,
demand, usage and quota use) and the wake request for a cold model with its reply. The conventions of
:mod:`llmgw_common.messages` hold (frozen, open world, UNIX seconds stamped by the sender).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from llmgw_common.messages import Message
from llmgw_common.names import RouterId


class IdleReport(Message):
    router: RouterId
    # The router's start: a replica it never routed to is idle for at least (now - since).
    since: float
    sent_at: float
    last_used: dict[str, float] = Field(default_factory=dict)
    # Replicas whose circuit breaker in this router is not closed: replica id -> "open" | "half_open".
    # Absent: closed (or never used). For `ctl replicas`.
    breakers: dict[str, str] = Field(default_factory=dict)
    # Replicas with a request of this router in flight now: never evicted or scaled down meanwhile (a
    # stream on a model's only replica has nowhere to be continued). Absent from older routers.
    in_flight: list[str] = Field(default_factory=list)


class ModelCache(Message):
    """One router's view of a model's routing by cached prefix (issue 32), counted since it started."""

    mode: str = "off"
    # Prompt tokens of the requests it predicted blocks for, and how many of them it expected cached on
    # the replica it chose.
    prompt_tokens: int = 0
    predicted_hit_tokens: int = 0
    # The engines' own counters (tokens), summed over the replicas whose load reports it holds.
    engine_queries: float = 0.0
    engine_hits: float = 0.0
    # Blocks in its index for the model, and how old the newest relayed batch was on arrival.
    index_blocks: int = 0
    event_lag_ms: float | None = None


class ModelDemand(Message):
    """One router's view of one model's load, for the replica count that follows it (issue 21)."""

    # This router's own, exact from its start (0 means none): proxied now, in its admission queue,
    # held while no replica is ready. No engine sees the last two.
    in_flight: int = 0
    queued: int = 0
    held: int = 0
    # From the agents' load reports this router holds fresh, summed (running, waiting) or the fullest
    # (kv_use) over ``replicas_reporting`` replicas; None where it holds none (a router that just started).
    replicas_reporting: int = 0
    running: float | None = None
    waiting: float | None = None
    kv_use: float | None = None
    # First byte of each answer it relayed over its last window: the p90 (a histogram bucket's upper
    # bound, so never below the truth) and how many; None with no answer in the window.
    ttft_p90_ms: float | None = None
    ttft_samples: int = 0
    # Seconds of the window the figures above cover (less than the window while the router is young).
    window_s: float = 0.0
    # Requests that reached this router for the model, and that it finished (answered or refused), over
    # the last ``rate_s`` (the model's up_after, at most the window): whether a queue is growing, and
    # how fast, which its length alone does not tell.
    arrived: int = 0
    completed: int = 0
    rate_s: float = 0.0
    # Routing by cached prefix; None from routers before issue 32, or with it off.
    cache: ModelCache | None = None


class DemandReport(Message):
    """Router -> control plane, every tick on ``Subjects.demand``: what it sees of each model's load.

    Since issue 35 a tick's report is what changed (``llmgw_router.demand_deltas``): ``models`` holds the
    entries that changed, ``gone`` the models no longer reported, and a model named in neither is as the
    router last said. A ``whole`` message starts the router's view anew (the entries of the messages
    after it with the same ``sent_at`` complete it). One tick's may be several messages, each bounded."""

    router: RouterId
    since: float
    sent_at: float
    models: dict[str, ModelDemand] = Field(default_factory=dict)
    # True (as from routers before issue 35, whose every report was whole): forget what this router said
    # before this message.
    whole: bool = True
    gone: list[str] = Field(default_factory=list)


class DemandWholeAsk(Message):
    """Control plane -> routers on ``Subjects.demand_whole``: a control plane that has just started
    (and so holds no router's view) asks every router for its whole demand report."""

    asked_at: float
    by: str = ""


class WakeState(StrEnum):
    SERVING = "serving"  # a ready replica exists already (the asker's view was stale)
    WAKING = "waking"  # a replica is placed or starting; watch the routing endpoints for it
    REFUSED = "refused"  # no replica can come now: ``reason`` says why, in the user's terms


class WakeRequest(Message):
    """Router -> control plane (request/reply on ``Subjects.wake``): a request is held for a cold model."""

    model: str
    router: RouterId
    sent_at: float


class WakeReply(Message):
    model: str
    state: WakeState
    reason: str = ""


class QuotaUse(Message):
    """One router's use of one limited meter (a key's or a team's limits, overall or for one model),
    for its peers' shares (``llmgw_router.quota``). Counts are of the windows named by their starts
    (UTC minute, day, month); a peer in another window counts zero in ours."""

    minute: float
    requests: int = 0
    tokens: int = 0
    day: float = 0.0
    day_tokens: int = 0
    month: float = 0.0
    month_tokens: int = 0
    in_flight: int = 0
    # Requests asked for (admitted or refused) in the sender's last tick: where the demand is.
    demand: int = 0
    # What the sender admitted in its last tick: a receiver extrapolates the sender's counts by it
    # for the time since the report (its use goes on while the report travels and waits).
    tick_requests: int = 0
    tick_tokens: int = 0
    # The sender's allowance of each limit now (rpm, tpm, concurrency, day, month; 0: no such limit):
    # it may admit up to these before its next tick, so a receiver counts them as taken.
    allow: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)


class UsageReport(Message):
    """Tokens counted by one router since it started, per key id and model."""

    router: RouterId
    since: float
    sent_at: float
    # key id -> model -> [requests, prompt tokens, completion tokens]
    usage: dict[str, dict[str, tuple[int, int, int]]] = Field(default_factory=dict)
    # One more per report of this router incarnation (``since``): a receiver drops a repeat or an
    # older one. 0 from routers before tenancy.
    seq: int = 0
    # Meter id (``llmgw_router.quota.meter_id``) -> this router's use of it. Absent from older routers.
    quota: dict[str, QuotaUse] = Field(default_factory=dict)
