"""vLLM's KV-event wire format: round trips, both schema forms, hostile input, real vLLM frames."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_common.errors import BadMessage
from llmgw_common.vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    KvWireError,
    decode_frames,
    encode_frames,
)
from tests.vllm.vllm_kit import install_root

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_kv" / "gemma-3-270m-cpu.msgpack"

u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
tokens = st.integers(min_value=0, max_value=(1 << 32) - 1)
small_str = st.text(max_size=12)
opt_str = st.none() | small_str
extra_entry = (
    st.none() | st.tuples(small_str) | st.tuples(st.tuples(small_str, st.integers(0, 1000)), small_str)
)


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(min_value=0, max_value=4))
    bs = draw(st.integers(min_value=1, max_value=4))
    return BlockStored(
        block_hashes=tuple(draw(st.lists(u64, min_size=n, max_size=n))),
        parent_block_hash=draw(st.none() | u64),
        token_ids=tuple(draw(st.lists(tokens, min_size=n * bs, max_size=n * bs))),
        block_size=bs,
        lora_name=draw(opt_str),
        extra_keys=draw(st.none() | st.lists(extra_entry, min_size=n, max_size=n).map(tuple)),
        group_idx=draw(st.none() | st.integers(0, 3)),
        kv_cache_spec_kind=draw(st.none() | st.sampled_from(["full_attention", "sliding_window"])),
        medium=draw(st.none() | st.sampled_from(["GPU", "CPU"])),
        kv_cache_spec_sliding_window=draw(st.none() | st.integers(1, 4096)),
    )


removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(u64, max_size=4).map(tuple),
    group_idx=st.none() | st.integers(0, 3),
    medium=st.none() | st.just("GPU"),
)
events = st.lists(stored() | removed | st.just(AllBlocksCleared()), max_size=6).map(tuple)
batches = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=events,
    dp_rank=st.none() | st.integers(0, 7),
)


@pytest.mark.slow
@given(topic=small_str, seq=u64, batch=batches)
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip(topic: str, seq: int, batch: EventBatch) -> None:
    frames = encode_frames(topic, seq, batch)
    assert len(frames) == 3 and frames[1] == seq.to_bytes(8, "big")
    assert decode_frames(frames) == (topic, seq, batch)


def _legacy(e: KvEvent) -> list[Any]:
    """The array form (pre-2026 vLLM): tag first, fields by position, trailing defaults left out."""
    if isinstance(e, BlockStored):
        row: list[Any] = ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids)]
        row += [e.block_size, None, e.medium, e.lora_name]
        tail = [
            None if e.extra_keys is None else [None if k is None else list(k) for k in e.extra_keys],
            e.group_idx,
            e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window,
        ]
        while tail and tail[-1] is None:
            tail.pop()
        return row + tail
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", list(e.block_hashes), e.medium] + (
            [e.group_idx] if e.group_idx is not None else []
        )
    return ["AllBlocksCleared"]


@pytest.mark.slow
@given(seq=u64, batch=batches)
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_legacy_array_form_decodes_the_same(seq: int, batch: EventBatch) -> None:
    payload = msgpack.packb([batch.ts, [_legacy(e) for e in batch.events], batch.dp_rank], use_bin_type=True)
    assert decode_frames([b"kv", seq.to_bytes(8, "big"), payload]) == ("kv", seq, batch)


def test_oldest_array_form_without_medium_and_two_element_batch() -> None:
    payload = msgpack.packb([1.0, [["BlockStored", [7], None, [1, 2], 2, None], ["BlockRemoved", [7]]]])
    _, _, batch = decode_frames([b"", bytes(8), payload])
    assert batch.events == (BlockStored((7,), None, (1, 2), 2), BlockRemoved((7,)))
    assert batch.dp_rank is None


def test_unknown_fields_ignored_unknown_events_counted() -> None:
    ev: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [5],
        "block_size": 1,
    }
    ev |= {"session_id": "s", "locality": "LOCAL", "future_field": {"x": [1, 2]}}
    payload = msgpack.packb([2.0, [ev, {"type": "BlockMoved", "to": "CPU"}, ["SomethingNew", 1]], 0])
    _, _, batch = decode_frames([b"kv", bytes(8), payload])
    assert batch.events == (BlockStored((1,), None, (5,), 1),)
    assert batch.unknown == 2


def test_bytes_block_hashes_become_vllms_ints() -> None:
    h = bytes(range(32))
    ev = {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": h,
        "token_ids": [1],
        "block_size": 1,
    }
    _, _, batch = decode_frames([b"", bytes(8), msgpack.packb([0.0, [ev], None], use_bin_type=True)])
    want = int.from_bytes(h, "big") & ((1 << 64) - 1)  # vLLM's maybe_convert_block_hash
    assert batch.events == (BlockStored((want,), want, (1,), 1),)


GOOD = {
    "type": "BlockStored",
    "block_hashes": [1],
    "parent_block_hash": None,
    "token_ids": [5],
    "block_size": 1,
}
HOSTILE: list[tuple[str, list[bytes]]] = [
    ("two frames", [b"kv", bytes(8)]),
    ("four frames", [b"kv", bytes(8), b"", b""]),
    ("seq of 4 bytes", [b"kv", bytes(4), msgpack.packb([0.0, []])]),
    ("topic not utf-8", [b"\xff\xfe", bytes(8), msgpack.packb([0.0, []])]),
    ("garbage", [b"kv", bytes(8), b"\xc1\xc1\xc1"]),
    ("truncated", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD]])[:-3]]),
    ("trailing data", [b"kv", bytes(8), msgpack.packb([0.0, []]) + b"\x00"]),
    ("not an array", [b"kv", bytes(8), msgpack.packb({"ts": 0})]),
    ("ts a string", [b"kv", bytes(8), msgpack.packb(["0", []])]),
    ("ts a bool", [b"kv", bytes(8), msgpack.packb([True, []])]),
    ("events a map", [b"kv", bytes(8), msgpack.packb([0.0, {}])]),
    ("event an int", [b"kv", bytes(8), msgpack.packb([0.0, [3]])]),
    ("event without tag", [b"kv", bytes(8), msgpack.packb([0.0, [{"block_hashes": []}]])]),
    ("empty array event", [b"kv", bytes(8), msgpack.packb([0.0, [[]]])]),
    ("hash a string", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD | {"block_hashes": ["x"]}]])]),
    ("hash a float", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD | {"parent_block_hash": 1.5}]])]),
    ("token negative", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD | {"token_ids": [-1]}]])]),
    ("token too big", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD | {"token_ids": [1 << 32]}]])]),
    ("block_size 0", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD | {"block_size": 0}]])]),
    ("no token_ids", [b"kv", bytes(8), msgpack.packb([0.0, [{"type": "BlockStored", "block_size": 1}]])]),
    ("group_idx a str", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD | {"group_idx": "0"}]])]),
    ("lora_name an int", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD | {"lora_name": 3}]])]),
    ("extra_keys a str", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD | {"extra_keys": "s"}]])]),
    ("extra_keys deep", [b"kv", bytes(8), msgpack.packb([0.0, [GOOD | {"extra_keys": [[[[[["x"]]]]]]}]])]),
    ("removed hashes None", [b"kv", bytes(8), msgpack.packb([0.0, [{"type": "BlockRemoved"}]])]),
    ("dp_rank a float", [b"kv", bytes(8), msgpack.packb([0.0, [], 1.5])]),
    ("unhashable map key", [b"kv", bytes(8), b"\x92\xcb" + bytes(8) + b"\x91\x81\x90\x00"]),
    ("array claims 2**32 items", [b"kv", bytes(8), b"\x92\x00\xdd\xff\xff\xff\xff"]),
    ("nesting 100000 deep", [b"kv", bytes(8), b"\x91" * 100_000]),
    ("payload over the limit", [b"kv", bytes(8), b"\x00" * (16 * 1024 * 1024 + 1)]),
]


@pytest.mark.parametrize(("why", "frames"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_raises_kv_wire_error(why: str, frames: list[bytes]) -> None:
    with pytest.raises(KvWireError):
        decode_frames(frames)


def test_kv_wire_error_is_a_bad_message() -> None:
    assert issubclass(KvWireError, BadMessage)


@given(st.lists(st.binary(max_size=64), min_size=3, max_size=3))
@settings(max_examples=300)
def test_random_bytes_never_raise_anything_else(frames: list[bytes]) -> None:
    try:
        decode_frames(frames)
    except KvWireError:
        pass


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=20,
)
event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
    optional={
        k: msgpack_values
        for k in (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "extra_keys",
            "group_idx",
            "lora_name",
            "medium",
        )
    },
)


@pytest.mark.slow
@given(st.lists(event_like | msgpack_values, max_size=4), msgpack_values)
@settings(max_examples=300)
def test_well_formed_msgpack_of_wrong_shapes_raises_only_kv_wire_error(evs: list[Any], rank: Any) -> None:
    try:
        decode_frames([b"kv", bytes(8), msgpack.packb([0.5, evs, rank], use_bin_type=True)])
    except KvWireError:
        pass


def test_encode_refuses_a_seq_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="seq"):
        encode_frames("kv", 1 << 64, EventBatch(0.0, ()))


# What vLLM 0.32 itself (msgspec over its own structs) writes for a batch, run in its own venv.
VLLM_ENCODE = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
ev = [
    BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                lora_id=None, medium="GPU", lora_name=None),
    BlockStored(block_hashes=[9], parent_block_hash=2**64 - 1, token_ids=[5, 6], block_size=2, lora_id=None,
                medium=None, lora_name="ad", extra_keys=[("ad", ("img", 0), "salt")], group_idx=1,
                kv_cache_spec_kind="sliding_window"),
    BlockRemoved(block_hashes=[1, 9], medium="GPU", group_idx=0),
    BlockRemoved(block_hashes=[2], medium=None),
    AllBlocksCleared(),
]
sys.stdout.buffer.write(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1764000000.25, events=ev,
                                                                     data_parallel_rank=0)))
"""
SAME_BATCH = EventBatch(
    ts=1764000000.25,
    events=(
        BlockStored((1, 2**64 - 1), None, (1, 2, 3, 4), 2, medium="GPU"),
        BlockStored(
            (9,),
            2**64 - 1,
            (5, 6),
            2,
            lora_name="ad",
            extra_keys=(("ad", ("img", 0), "salt"),),
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
        ),
        BlockRemoved((1, 9), group_idx=0, medium="GPU"),
        BlockRemoved((2,)),
        AllBlocksCleared(),
    ),
    dp_rank=0,
)


@pytest.mark.slow
def test_encode_is_byte_for_byte_what_vllm_writes() -> None:
    python = install_root() / "venv" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"vLLM not installed ({python}): run `make vllm`")
    out = subprocess.run([str(python), "-c", VLLM_ENCODE], capture_output=True, timeout=300, check=True)
    assert encode_frames("kv", 0, SAME_BATCH)[2] == out.stdout
    assert decode_frames([b"kv", bytes(8), out.stdout])[2] == SAME_BATCH


def _captured() -> dict[str, Any]:
    if not FIXTURE.exists():
        pytest.skip(f"no {FIXTURE.name} (tests/fixtures/vllm_kv/capture.py makes it)")
    data: dict[str, Any] = msgpack.unpackb(FIXTURE.read_bytes(), raw=False)
    return data


def test_real_vllm_frames_decode_and_reencode_identically() -> None:
    data = _captured()
    assert data["frames"], "the capture holds no messages"
    seqs = []
    for frames in data["frames"]:
        topic, seq, batch = decode_frames(frames)
        assert topic == "kv" and batch.unknown == 0
        seqs.append(seq)
        assert encode_frames(topic, seq, batch) == frames
    assert seqs == list(range(len(seqs)))  # one publisher from its start: 0, 1, 2, ...


def test_real_vllm_stores_blocks_of_128_tokens_per_group() -> None:
    stored = [
        e
        for frames in _captured()["frames"]
        for e in decode_frames(frames)[2].events
        if isinstance(e, BlockStored)
    ]
    assert stored
    for e in stored:
        assert e.block_size == 128 and len(e.token_ids) == 128 * len(e.block_hashes)
    # Gemma 3 270M: five sliding-window groups (window 512) and one full-attention group, each
    # reporting the same tokens under its own hashes.
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored}
    assert kinds == {(g, "sliding_window", 512) for g in range(5)} | {(5, "full_attention", None)}, kinds


def test_real_vllm_reports_the_cache_salt_in_the_first_blocks_extra_keys() -> None:
    data = _captured()
    salted = data["prompts"][2]["body"]["cache_salt"]
    full = [
        e
        for frames in data["frames"]
        for e in decode_frames(frames)[2].events
        if isinstance(e, BlockStored) and e.kv_cache_spec_kind == "full_attention"
    ]
    # The first request's three blocks unsalted; the second turn adds no full block (498 tokens);
    # the salted request stores the same tokens again under new hashes, the salt on its first block.
    assert [e.extra_keys for e in full] == [(None, None, None), ((salted,), None, None)]
    assert full[0].token_ids == full[1].token_ids and set(full[0].block_hashes).isdisjoint(
        full[1].block_hashes
    )
