"""llmgw_common.kvcache: block keys over token ids, salts, and the salt a tenant kept apart gets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_common.kvcache import (
    ROOT_KEY,
    SaltRefused,
    block_keys,
    chain_key,
    request_salt,
    root_key,
    tenant_salt,
)

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)


@given(tokens, st.integers(min_value=1, max_value=64))
def test_keys_are_a_chain_over_full_blocks_only(ts: list[int], size: int) -> None:
    keys = block_keys(ts, size)
    assert len(keys) == len(ts) // size
    parent = ROOT_KEY
    for i, k in enumerate(keys):
        assert k == chain_key(parent, ts[i * size : (i + 1) * size])
        parent = k


@given(tokens, tokens, st.integers(min_value=1, max_value=16))
def test_a_shared_prefix_shares_exactly_its_full_blocks(a: list[int], b: list[int], size: int) -> None:
    ka, kb = block_keys(a, size), block_keys(b, size)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared = 0
    while shared < min(len(ka), len(kb)) and ka[shared] == kb[shared]:
        shared += 1
    assert shared == min(common // size, len(ka), len(kb))


def test_a_salt_changes_every_key_and_no_salt_is_the_root() -> None:
    ts = list(range(64))
    assert root_key(None) == root_key("") == ROOT_KEY
    plain, salted = block_keys(ts, 16), block_keys(ts, 16, salt=request_salt(None, "s"))
    assert not set(plain) & set(salted)
    assert request_salt(None, None) is None
    assert request_salt("lora-a", None) != request_salt(None, "lora-a")


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        block_keys([1, 2], 0)


def test_a_tenant_kept_apart_gets_its_own_salt_and_cannot_forge_another() -> None:
    assert tenant_salt("shared", "k-1", "ml", None) is None
    assert tenant_salt("shared", "k-1", "ml", "mine") == "mine"
    assert tenant_salt("key", "k-1", "ml", None) == "llmgw:key:k-1"
    assert tenant_salt("team", "k-1", "ml", "x") == "llmgw:team:ml:x"
    # A team scope without a team keeps the key to itself rather than share with everyone.
    assert tenant_salt("team", "k-1", None, None) == "llmgw:key:k-1"
    with pytest.raises(SaltRefused, match="reserved for the gateway"):
        tenant_salt("shared", "k-2", None, "llmgw:key:k-1")
