"""Engine KV events -> llmgw block keys, on plain data: chains, salts, groups, restarts, gaps, garbage."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_agent import kvstate
from llmgw_agent.kvtranslate import ReplicaBlocks, poisoned
from llmgw_common.kvcache import block_keys, chain_key, request_salt, root_key
from llmgw_common.vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_frames

BS = 4
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_kv" / "gemma-3-270m-cpu.msgpack"


def toks(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def stored(hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...], **kw: object) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, **kw)  # type: ignore[arg-type]


def batch(*events: object) -> EventBatch:
    return EventBatch(0.0, tuple(events))  # type: ignore[arg-type]


def test_a_chain_of_stores_gives_the_keys_a_router_predicts() -> None:
    r = ReplicaBlocks()
    prompt = toks(3 * BS + 2)
    c1 = r.apply(0, batch(stored((11, 12), None, prompt[: 2 * BS])))
    c2 = r.apply(1, batch(stored((13,), 12, prompt[2 * BS : 3 * BS])))
    want = block_keys(prompt, BS)
    assert list(c1.stored) == sorted(want[:2]) and c2.stored == (want[2],)
    assert r.keys == set(want) and not c1.cleared and not c2.cleared
    assert r.block_size == BS


def test_removed_keys_leave_and_unknown_hashes_are_ignored() -> None:
    r = ReplicaBlocks()
    r.apply(0, batch(stored((1, 2), None, toks(2 * BS))))
    want = block_keys(toks(2 * BS), BS)
    c = r.apply(1, batch(BlockRemoved((2, 999))))
    assert c.removed == (want[1],) and c.stored == () and r.keys == {want[0]}


def test_stored_then_removed_in_one_batch_is_nothing() -> None:
    r = ReplicaBlocks()
    r.apply(0, batch(stored((1,), None, toks(BS))))
    c = r.apply(
        1,
        batch(
            stored((2,), 1, toks(BS, 100)),
            BlockRemoved((2,)),
            BlockRemoved((1,)),
            stored((1,), None, toks(BS)),
        ),
    )
    # 2 came and went; 1 went and came back: the receiver's set is right as it is.
    assert c.empty and r.keys == set(block_keys(toks(BS), BS))


def test_cache_salt_and_lora_enter_the_root() -> None:
    r = ReplicaBlocks()
    tokens = toks(2 * BS)
    c = r.apply(0, batch(stored((1, 2), None, tokens, extra_keys=(("tenant-a",), None))))
    assert set(c.stored) == set(block_keys(tokens, BS, request_salt(None, "tenant-a")))
    assert set(c.stored).isdisjoint(block_keys(tokens, BS))
    # With a LoRA its name comes first in every block's extra keys; the salt after it on the first.
    r2 = ReplicaBlocks()
    ek = (("ad", "tenant-a"), ("ad",))
    c2 = r2.apply(0, batch(stored((1, 2), None, tokens, lora_name="ad", extra_keys=ek)))
    assert set(c2.stored) == set(block_keys(tokens, BS, request_salt("ad", "tenant-a")))
    r3 = ReplicaBlocks()
    c3 = r3.apply(0, batch(stored((1,), None, tokens[:BS], lora_name="ad", extra_keys=(("ad",),))))
    assert set(c3.stored) == set(block_keys(tokens[:BS], BS, request_salt("ad", None)))


def test_multimodal_blocks_never_match_a_text_prediction() -> None:
    r = ReplicaBlocks()
    tokens = toks(3 * BS)
    ek = (None, (("img-sha", 0),), None)
    c = r.apply(0, batch(stored((1, 2, 3), None, tokens, extra_keys=ek)))
    text = block_keys(tokens, BS)
    assert text[0] in c.stored  # the block before the image is plain text
    assert text[1] not in c.stored and text[2] not in c.stored
    k1 = chain_key(poisoned(text[0], (("img-sha", 0),)), tokens[BS : 2 * BS])
    assert set(c.stored) == {text[0], k1, chain_key(k1, tokens[2 * BS :])}
    # Another image with the same placeholder tokens: other keys.
    r2 = ReplicaBlocks()
    c2 = r2.apply(0, batch(stored((1, 2, 3), None, tokens, extra_keys=(None, (("other", 0),), None))))
    assert set(c2.stored) & set(c.stored) == {text[0]}


def test_only_the_full_attention_group_is_indexed() -> None:
    r = ReplicaBlocks()
    tokens = toks(BS)
    c = r.apply(
        0,
        batch(
            stored(
                (1,),
                None,
                tokens,
                group_idx=0,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=8,
            ),
            stored((2,), None, tokens, group_idx=1, kv_cache_spec_kind="full_attention"),
        ),
    )
    assert c.stored == tuple(block_keys(tokens, BS)) and c.orphans == 1 and r.group == 1
    # A remove of the sliding-window group's block (same tokens) leaves the full-attention one.
    assert r.apply(1, batch(BlockRemoved((1,), group_idx=0), BlockRemoved((2,), group_idx=0))).empty
    assert r.apply(2, batch(BlockRemoved((2,), group_idx=1))).removed == c.stored


def test_another_medium_is_not_indexed() -> None:
    r = ReplicaBlocks()
    assert r.apply(0, batch(stored((1,), None, toks(BS), medium="CPU"))).empty
    assert r.apply(1, batch(stored((1,), None, toks(BS), medium="GPU"))).stored


def test_a_falling_sequence_clears_the_replica() -> None:
    r = ReplicaBlocks()
    r.apply(5, batch(stored((1,), None, toks(BS))))
    c = r.apply(0, batch(stored((7,), None, toks(BS, 50))))
    assert c.cleared and "restarted" in c.reason
    assert c.stored == tuple(block_keys(toks(BS, 50), BS)) and r.keys == set(c.stored)


def test_a_gap_clears_and_orphans_are_skipped() -> None:
    r = ReplicaBlocks()
    r.apply(0, batch(stored((1,), None, toks(BS))))
    # Batch 1 was lost; batch 2 continues a chain from a block it stored.
    c = r.apply(2, batch(stored((3,), 2, toks(BS, 8)), stored((4,), None, toks(BS, 20))))
    assert c.cleared and "lost" in c.reason and c.orphans == 1
    assert c.stored == tuple(block_keys(toks(BS, 20), BS)) and r.keys == set(c.stored)
    # A child of the skipped block is skipped too: never a key from a wrong chain.
    assert r.apply(3, batch(stored((5,), 3, toks(BS)))).orphans == 1 and len(r) == 1


def test_joined_mid_stream_starts_without_a_clear() -> None:
    r = ReplicaBlocks()
    c = r.apply(40, batch(stored((1,), None, toks(BS))))
    assert not c.cleared and len(r) == 1


def test_all_blocks_cleared_clears() -> None:
    r = ReplicaBlocks()
    r.apply(0, batch(stored((1,), None, toks(BS))))
    c = r.apply(1, batch(AllBlocksCleared(), stored((2,), None, toks(BS, 9))))
    assert c.cleared and c.reason == "" and r.keys == set(block_keys(toks(BS, 9), BS))


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (BlockStored((1, 2), None, toks(BS), BS), "carries"),
        (BlockStored((1,), None, toks(BS), BS, extra_keys=(None, None)), "extra_keys"),
        (BlockStored((9,), None, toks(8), 8), "block size changed"),
    ],
)
def test_a_batch_that_does_not_fit_clears_the_replica(event: BlockStored, why: str) -> None:
    r = ReplicaBlocks()
    r.apply(0, batch(stored((1,), None, toks(BS))))
    c = r.apply(1, batch(stored((5,), 1, toks(BS, 40)), event))
    assert c.cleared and why in c.reason and len(r) == 0 and c.stored == ()
    # And the next batch follows on: nothing stays wrong, nothing stays stuck.
    assert r.apply(2, batch(stored((6,), None, toks(BS)))).stored == tuple(block_keys(toks(BS), BS))


def test_a_lost_batch_clears_and_restarts_the_sequence() -> None:
    r = ReplicaBlocks()
    r.apply(0, batch(stored((1,), None, toks(BS))))
    c = r.lost("undecodable")
    assert c.cleared and c.reason == "undecodable" and len(r) == 0 and r.last_seq is None
    assert not r.apply(7, batch()).cleared


def test_two_hashes_one_key_leave_only_with_the_last() -> None:
    r = ReplicaBlocks()
    r.apply(0, batch(stored((1,), None, toks(BS)), stored((2,), None, toks(BS))))
    assert len(r) == 1
    assert r.apply(1, batch(BlockRemoved((1,)))).empty
    assert r.apply(2, batch(BlockRemoved((2,)))).removed == tuple(block_keys(toks(BS), BS))


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=40))
def test_the_key_set_is_always_the_keys_of_the_blocks_held(ops: list[tuple[bool, int]]) -> None:
    """Oracle: a model of the engine's cache (hash -> tokens, all first blocks) against the index."""
    r = ReplicaBlocks()
    held: dict[int, tuple[int, ...]] = {}
    published: set[int] = set()
    seq = 0
    for store, h in ops:
        if store and h not in held:
            held[h] = toks(BS, 10 * (h % 4))  # hashes 0 and 4 hold the same tokens
            c = r.apply(seq, batch(stored((h,), None, held[h])))
        elif not store and h in held:
            del held[h]
            c = r.apply(seq, batch(BlockRemoved((h,))))
        else:
            continue
        seq += 1
        assert not c.cleared
        published = (published | set(c.stored)) - set(c.removed)
        want = {block_keys(t, BS)[0] for t in held.values()}
        assert r.keys == want == published


def test_real_vllm_events_give_the_keys_of_the_prompt_tokens() -> None:
    if not FIXTURE.exists():
        pytest.skip("no captured vLLM frames")
    data = msgpack.unpackb(FIXTURE.read_bytes(), raw=False)
    r = ReplicaBlocks()
    got: set[int] = set()
    for frames in data["frames"]:
        _, seq, b = decode_frames(frames)
        got |= set(r.apply(seq, b).stored)
    first = [e for e in decode_frames(data["frames"][0])[2].events if isinstance(e, BlockStored)][-1]
    assert r.group == 5 and r.block_size == 128
    salt = data["prompts"][2]["body"]["cache_salt"]
    want = set(block_keys(first.token_ids, 128)) | set(
        block_keys(first.token_ids, 128, request_salt(None, salt))
    )
    assert got == want == r.keys and len(got) == 6
    assert root_key(request_salt(None, salt)) != root_key()


def test_saved_blocks_load_only_for_the_same_engine() -> None:
    r = ReplicaBlocks()
    r.apply(0, batch(stored((1, 2), None, toks(2 * BS)), stored((3,), None, toks(BS))))
    back = kvstate.load(kvstate.dump("123:4.5", r), "123:4.5")
    assert back is not None
    assert (back.by_hash, back.refs, back.last_seq, back.block_size, back.group) == (
        r.by_hash, r.refs, 0, BS, None,
    )  # fmt: skip
    # It goes on from there as the original would.
    assert back.apply(1, batch(stored((4,), 2, toks(BS, 60)))) == r.apply(
        1, batch(stored((4,), 2, toks(BS, 60)))
    )
    assert kvstate.load(kvstate.dump("123:4.5", r), "999:1.0") is None  # another process
    assert kvstate.load(b"\xc1 garbage", "123:4.5") is None
    assert kvstate.load(b"\x93\x01\x02\x03", "123:4.5") is None
