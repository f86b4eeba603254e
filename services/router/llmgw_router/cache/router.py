"""What the request path calls to route by cached prefix: :class:`PrefixRouting`, three calls.

- ``prefix(model, body, salt)``: the request's prompt as block keys, the way the model's engines name
  what they cache (its own tokenizer and chat template, its engines' block size, the tenant's salt); or
  None where the model routes by load alone (mode ``off``, no tokenizer loaded yet, no replica reported
  a block size yet, a prompt that cannot be predicted).
- ``choose(model, candidates, prefix, now, rng)``: the candidate to send it to (``score.choose``: cached
  prefix against load, within the load bound; by load alone, as the router's P2C, without a prefix).
- ``sent(model, replica, prefix, now)``: the request went to ``replica``: counted (predicted hit tokens
  against prompt tokens), and in approximate mode learned.

Per model, the mode is the catalog profile's ``cache_routing_mode``: ``events`` reads the exact index
(``index.py``, fed by ``follower.py``), ``approximate`` this router's own decisions (``approx.py``). In
approximate mode a model with no tokenizer in the store (llama.cpp's GGUF carries its own) is keyed by
its prompt's text instead: only this router compares those keys, so any prefix-stable function does.
Nothing here does I/O; the follower and the tokenizer store run beside it.

Cost on the request path, gemma-3-270m's tokenizer, a 9-message chat of ~2,050 tokens, 16 replicas
(2 holding the whole prompt), median of 200 on the loaded 2-core build machine: block keys 0.08 ms
(16-token blocks; 0.02 ms at vLLM CPU's 128), match + choice + sent 0.02 ms; tokenizing is the rest
and dominates: 0.07 ms for a body seen before, 0.35 ms for a new last turn (earlier turns from the
tokenizer's segment cache), 2.4 ms for a wholly new conversation.
"""

from __future__ import annotations

import json
import random
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from llmgw_common.catalog import CacheRouting, ModelProfile
from llmgw_common.kvcache import block_keys
from llmgw_router.cache import score
from llmgw_router.cache.approx import ApproxIndex
from llmgw_router.cache.index import KvIndex
from llmgw_router.cache.tokenizers import PromptTokenizer

C = TypeVar("C", bound=score.Candidate)


class Tokenizers(Protocol):
    """Where tokenizers are found (``tokenizers.TokenizerStore``)."""

    def get(self, model: str) -> PromptTokenizer | None: ...


class EventLag(Protocol):
    """How late the relayed events arrive (``follower.KvEventFollower``)."""

    @property
    def lag_by_model(self) -> Mapping[str, float]: ...


# How long a prompt sent is taken as cached before the engine's events say so, and how many
# (replica, block) pairs that holds at most (~78 MB per million).
PENDING_TTL_S = 5.0
PENDING_MAX_ENTRIES = 200_000


@dataclass(frozen=True, slots=True)
class CacheLimits:
    # A load report older than this is ignored (the router's load_stale_s).
    stale_s: float = 5.0
    # No replica takes more than this times its share of this router's in-flight requests (>= 1).
    load_factor: float = 1.25
    # Prompt tokens of prefill that weigh as much as one request of load (score.py).
    tokens_per_load: float = score.DEFAULT_TOKENS_PER_LOAD
    # Approximate mode: the block size of its keys (no engine names one), and, without a tokenizer, the
    # bytes of prompt text per block (~4 bytes a token).
    approx_block_size: int = 16
    approx_text_block_bytes: int = 64


@dataclass(frozen=True, slots=True)
class Prefix:
    """A request's prompt as block keys, in order (full blocks only)."""

    mode: CacheRouting
    keys: Sequence[int]
    block_size: int
    prompt_tokens: int


@dataclass(slots=True)
class ModelCacheStats:
    """Counted since the router started, per model (``llmgw_common.router_messages.ModelCache``'s fields)."""

    mode: CacheRouting = CacheRouting.OFF
    # Requests sent with a prefix, their prompt tokens, and the tokens expected cached where they went.
    requests: int = 0
    prompt_tokens: int = 0
    predicted_hit_tokens: int = 0
    # Requests routed by load alone: no tokenizer loaded yet / no block size known yet / unpredictable.
    no_tokenizer: int = 0
    no_block_size: int = 0
    unpredictable: int = 0


class PrefixRouting:
    def __init__(
        self,
        index: KvIndex,
        tokenizers: Tokenizers,
        limits: CacheLimits | None = None,
        approx: ApproxIndex | None = None,
        lag: EventLag | None = None,
    ) -> None:
        self.index = index
        self.tokenizers = tokenizers
        self.limits = limits or CacheLimits()
        self.approx = approx or ApproxIndex()
        # Events mode: where this router just sent a prompt, taken as cached there until the engine's own
        # events confirm it (they come in batches every 50 ms, then cross the bus): an agent's next step
        # or a quick next turn sent before then still finds its replica. Short-lived, bounded.
        self.pending = ApproxIndex(ttl_s=PENDING_TTL_S, max_entries=PENDING_MAX_ENTRIES)
        self.lag = lag
        self._modes: dict[str, CacheRouting] = {}
        self._stats: dict[str, ModelCacheStats] = {}

    # ------------------------------------------------------------------ wiring

    def set_catalog(self, profiles: Iterable[ModelProfile]) -> None:
        """Each model's mode from its profile; models that left stop being counted."""
        self._modes = {p.name: p.cache_routing_mode for p in profiles}
        self._stats = {m: self._stats.get(m) or ModelCacheStats() for m in self._modes}
        for m, st in self._stats.items():
            st.mode = self._modes[m]

    def mode(self, model: str) -> CacheRouting:
        return self._modes.get(model, CacheRouting.OFF)

    def retain(self, replicas: Iterable[str]) -> None:
        """The routing table's replicas now: the approximate index forgets the others (the exact index's
        are dropped by the follower's ``retain``)."""
        keep = set(replicas)
        self.approx.retain(keep)
        self.pending.retain(keep)

    # ------------------------------------------------------------------ the request path

    def prefix(self, model: str, body: Mapping[str, Any], salt: str | None) -> Prefix | None:
        mode = self._modes.get(model)
        if mode is None or mode is CacheRouting.OFF:
            return None
        st = self._stats[model]
        tok = self.tokenizers.get(model)
        if mode is CacheRouting.EVENTS:
            if tok is None:
                st.no_tokenizer += 1
                return None
            bs = self.index.block_size(model)
            if bs is None:
                st.no_block_size += 1
                return None
            ids = tok.prompt_ids(body)
            if ids is None:
                st.unpredictable += 1
                return None
            return Prefix(mode, block_keys(ids, bs, salt), bs, len(ids))
        if tok is not None:
            ids = tok.prompt_ids(body)
            if ids is None:
                st.unpredictable += 1
                return None
            bs = self.limits.approx_block_size
            return Prefix(mode, block_keys(ids, bs, salt), bs, len(ids))
        units = text_units(body)
        if units is None:
            st.unpredictable += 1
            return None
        per = max(1, self.limits.approx_text_block_bytes // 4)
        # A unit is 4 bytes of text, about a token: the prompt's size in tokens is about its units'.
        return Prefix(mode, block_keys(units, per, salt), per, len(units))

    def choose(
        self,
        model: str,
        candidates: Sequence[C],
        prefix: Prefix | None,
        now: float,
        rng: random.Random | Callable[[], float],
    ) -> C | None:
        hits: Mapping[str, int] = {}
        if prefix is not None and prefix.keys:
            if prefix.mode is CacheRouting.EVENTS:
                hits = self.index.match(model, prefix.keys)
                sent = self.pending.match(model, prefix.keys, now)
                if sent:
                    hits = {r: max(hits.get(r, 0), n) for r, n in (*hits.items(), *sent.items())}
            else:
                hits = self.approx.match(model, prefix.keys, now)
        lim = self.limits
        blocks = len(prefix.keys) if prefix is not None else 0
        bs = prefix.block_size if prefix is not None else 1
        return score.choose(
            candidates, hits, bs, blocks, now, lim.stale_s, rng, lim.load_factor, lim.tokens_per_load
        )

    def sent(self, model: str, replica: str, prefix: Prefix | None, now: float) -> None:
        if prefix is None:
            return
        st = self._stats.get(model)
        if prefix.mode is CacheRouting.EVENTS:
            hit = self.index.match_one(model, replica, prefix.keys)
            self.pending.record(model, replica, prefix.keys, now)
        else:
            hit = self.approx.match(model, prefix.keys, now).get(replica, 0)
            self.approx.record(model, replica, prefix.keys, now)
        if st is not None:
            st.requests += 1
            st.prompt_tokens += prefix.prompt_tokens
            st.predicted_hit_tokens += min(hit * prefix.block_size, prefix.prompt_tokens)

    # ------------------------------------------------------------------ for operators

    def stats(self) -> dict[str, ModelCacheStats]:
        """Per catalog model, what was counted (live objects: read, do not keep)."""
        return self._stats

    def index_blocks(self, model: str) -> int:
        return self.index.blocks(model) if self.mode(model) is CacheRouting.EVENTS else 0

    def event_lag_ms(self, model: str) -> float | None:
        if self.lag is None:
            return None
        lag = self.lag.lag_by_model.get(model)
        return None if lag is None else lag * 1000.0


def text_units(body: Mapping[str, Any]) -> list[int] | None:
    """A prompt's text as 4-byte units, prefix-stable as a conversation grows (approximate mode without a
    tokenizer): a chat's messages as compact JSON without the closing bracket (a later turn's text starts
    with an earlier turn's), a completion's prompt string; token ids are taken as they are. None where
    there is no single prompt."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        text = json.dumps(messages, ensure_ascii=False, separators=(",", ":"), sort_keys=True)[:-1]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 1 << 32 for t in prompt):
            return list(prompt)
        else:
            return None
    data = text.encode()
    units = array("I")
    units.frombytes(data[: len(data) - len(data) % 4])
    return units.tolist()
