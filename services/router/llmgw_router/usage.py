"""Tokens per key and model, counted from answers and streamed ``usage`` chunks, reported per tick.

Usage is picked out of the bytes without parsing the whole answer: OpenAI puts ``usage`` at the end
of a JSON answer and in the last chunk of a stream (with ``stream_options.include_usage``), so only
the tail after the last ``"usage"`` is searched.
"""

from __future__ import annotations

import re

from llmgw_common.messages import UsageReport

_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
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
    __slots__ = ("since", "usage")

    def __init__(self, since: float) -> None:
        self.since = since
        # key id -> model -> [requests, prompt tokens, completion tokens]
        self.usage: dict[str, dict[str, list[int]]] = {}

    def add(self, key_id: str, model: str, tokens: tuple[int, int] | None) -> None:
        per_model = self.usage.get(key_id)
        if per_model is None:
            per_model = self.usage[key_id] = {}
        row = per_model.get(model)
        if row is None:
            row = per_model[model] = [0, 0, 0]
        row[0] += 1
        if tokens is not None:
            row[1] += tokens[0]
            row[2] += tokens[1]

    def report(self, router: str, now: float) -> UsageReport:
        return UsageReport(
            router=router,
            since=self.since,
            sent_at=now,
            usage={k: {m: (r[0], r[1], r[2]) for m, r in per.items()} for k, per in self.usage.items()},
        )
