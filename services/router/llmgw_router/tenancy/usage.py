"""Tokens per key and model, counted from answers and streamed ``usage`` chunks, reported per tick.

Usage is picked out of the bytes without parsing the whole answer: OpenAI puts ``usage`` at the end
of a JSON answer and in the last chunk of a stream (with ``stream_options.include_usage``), so only
the tail after the last ``"usage"`` is searched.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from llmgw_common.router_messages import UsageReport
from llmgw_runtime.usage_ledger import hour_start

if TYPE_CHECKING:
    from llmgw_router.tenancy.quota import Quotas


class Ledger(Protocol):
    """What the table asks of its durable writer (ledger.Ledger, which reads the table: named here by
    what it does, so the two modules do not import each other)."""

    def kick(self) -> None:
        """Something was added: write soon."""


# OpenAI's chat and completions name them prompt/completion; the Responses API and Anthropic's
# Messages input/output (whose ``input_tokens_details`` the closing quote keeps out).
_PROMPT = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_NULL = re.compile(rb'"usage"\s*:\s*null')
_TOTAL = re.compile(rb'"total_tokens"\s*:\s*(\d+)')
# A stream's usage chunk is small; keep this much of a stream's tail to find it.
TAIL_BYTES = 4096


def find_usage(data: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the last ``"usage"`` object in ``data``; None when absent."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    tail = data[at : at + 1024]
    if _NULL.match(tail):
        return None
    p = _PROMPT.search(tail)
    if p is None:
        return None
    c = _COMPLETION.search(tail)
    if c is not None:
        return int(p.group(1)), int(c.group(1))
    t = _TOTAL.search(tail)  # embeddings: prompt and total only
    return int(p.group(1)), (int(t.group(1)) - int(p.group(1))) if t else 0


class UsageTable:
    __slots__ = ("clock", "dirty", "hours", "ledger", "quota", "seq", "since", "usage", "version")

    def __init__(
        self, since: float, quota: Quotas | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.since = since
        # key id -> model -> [requests, prompt tokens, completion tokens]
        self.usage: dict[str, dict[str, list[int]]] = {}
        # Where a limited key's tokens are counted against its limits, once its answer's usage is known.
        self.quota = quota
        self.clock = clock
        self.seq = 0
        # The same counts per UTC hour, for the durable ledger (ledger.py): hour -> key -> model -> row;
        # the hours changed since its last write; one more per add (what a write has covered).
        self.hours: dict[float, dict[str, dict[str, list[int]]]] = {}
        self.dirty: set[float] = set()
        self.version = 0
        self.ledger: Ledger | None = None

    def add(self, key_id: str, model: str, tokens: tuple[int, int] | None, streamed: int = 0) -> None:
        """One answer; ``streamed``: the tokens its key's limits were charged as it streamed (proxy.py),
        made good to the answer's usage when it has one (else they stand as the estimate)."""
        q = self.quota
        now = self.clock()
        if tokens is not None and q is not None and key_id in q.active:
            q.add_tokens(key_id, model, tokens[0] + tokens[1] - streamed, now)
        hour = hour_start(now)
        hourly = self.hours.get(hour)
        if hourly is None:
            hourly = self.hours[hour] = {}
        for table in (self.usage, hourly):
            per_model = table.get(key_id)
            if per_model is None:
                per_model = table[key_id] = {}
            row = per_model.get(model)
            if row is None:
                row = per_model[model] = [0, 0, 0]
            row[0] += 1
            if tokens is not None:
                row[1] += tokens[0]
                row[2] += tokens[1]
        self.dirty.add(hour)
        self.version += 1
        if self.ledger is not None:
            self.ledger.kick()

    def report(self, router: str, now: float) -> UsageReport:
        self.seq += 1
        quota = {} if self.quota is None else self.quota.report()
        return UsageReport(
            router=router,
            since=self.since,
            sent_at=now,
            usage={k: {m: (r[0], r[1], r[2]) for m, r in per.items()} for k, per in self.usage.items()},
            seq=self.seq,
            quota=quota,
        )
