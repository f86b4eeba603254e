"""The approximate index (llmgw_router.cache.approx): learned from decisions, aged on a fake clock."""

from __future__ import annotations

import pytest

from llmgw_common.kvcache import block_keys
from llmgw_router.cache.approx import ApproxIndex

KEYS = block_keys(list(range(40)), 4)  # 10 blocks


def test_a_recorded_prompt_matches_as_its_longest_prefix() -> None:
    ix = ApproxIndex(ttl_s=60)
    ix.record("m", "a", KEYS[:6], now=0.0)
    ix.record("m", "b", KEYS[:2], now=1.0)
    ix.record("m", "c", KEYS[1:], now=1.0)  # no first block: nothing usable
    assert ix.match("m", KEYS, now=2.0) == {"a": 6, "b": 2}
    assert ix.match("m2", KEYS, now=2.0) == {}
    assert ix.match("m", [], now=2.0) == {}
    assert ix.entries == 6 + 2 + 9
    # Recording the same again adds nothing.
    ix.record("m", "a", KEYS[:6], now=3.0)
    assert ix.entries == 17  # the same generation (a span is 15 s) holds them once
    assert ix.replicas() == ["a", "b", "c"]


def test_entries_expire_between_ttl_and_ttl_plus_a_generation() -> None:
    ix = ApproxIndex(ttl_s=40, generations=4)  # a generation spans 10 s
    ix.record("m", "a", KEYS, now=0.0)
    assert ix.match("m", KEYS, now=39.9) == {"a": 10}
    assert ix.match("m", KEYS, now=49.9) == {"a": 10}  # its generation ended at 10 s
    assert ix.match("m", KEYS, now=50.0) == {}
    assert ix.entries == 0


def test_a_later_record_keeps_a_prefix_alive() -> None:
    ix = ApproxIndex(ttl_s=40, generations=4)
    ix.record("m", "a", KEYS, now=0.0)
    ix.record("m", "a", KEYS[:3], now=35.0)  # a later turn of the same conversation
    assert ix.match("m", KEYS, now=60.0) == {"a": 3}
    assert ix.match("m", KEYS, now=85.0) == {}


def test_drop_is_at_once_and_the_slot_is_reused_only_once_aged_out() -> None:
    ix = ApproxIndex(ttl_s=40, generations=4)
    ix.record("m", "a", KEYS, now=0.0)
    ix.drop("a")
    ix.drop("nobody")
    assert ix.match("m", KEYS, now=1.0) == {}
    ix.record("m", "b", KEYS[:1], now=2.0)  # must not take a's slot: a's bits are still in the dict
    assert ix.match("m", KEYS, now=3.0) == {"b": 1}
    ix.record("m", "c", [], now=60.0)  # a's generation is gone: its slot is free again
    assert ix.match("m", KEYS, now=60.0) == {}
    assert ix.retain(["c"]) == ["b"]
    assert ix.replicas() == ["c"]


def test_the_cap_drops_the_oldest_generation_then_refuses() -> None:
    ix = ApproxIndex(ttl_s=40, generations=4, max_entries=12)
    ix.record("m", "a", KEYS[:8], now=0.0)
    ix.record("m", "b", KEYS[:8], now=11.0)  # a new generation: the cap drops the first one
    assert ix.match("m", KEYS, now=12.0) == {"b": 8}
    assert ix.entries == 8
    ix.record("m", "c", KEYS[:8], now=13.0)  # same generation as b's: 4 fit, then refused
    assert ix.entries == 12 and ix.refused == 1
    assert ix.match("m", KEYS, now=14.0) == {"b": 8, "c": 4}


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        ApproxIndex(ttl_s=0)
    with pytest.raises(ValueError):
        ApproxIndex(generations=0)
