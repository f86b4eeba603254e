"""vLLM's KV-cache events on the wire (ZMQ), decoded and encoded without vLLM; no I/O.

What vLLM 0.32 sends (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): one ZMQ message of
three frames per batch, ``topic`` (utf-8), the batch's sequence number (8 bytes, big-endian, counted
from 0 by each publisher) and a msgpack payload encoded by msgspec::

    [ts, [event, ...], data_parallel_rank]        # EventBatch: array_like, so a 3-array

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil, "token_ids": [...],
     "block_size": n, "lora_id": nil, "medium": "GPU" | nil, "lora_name": s | nil,
     ["extra_keys": [[...] | nil, ...]], ["group_idx": g], ["kv_cache_spec_kind": "full_attention"],
     ["kv_cache_spec_sliding_window": 512], ...}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": m | nil, ["group_idx": g], ...}
    {"type": "AllBlocksCleared"}

An event is a map tagged by ``type`` (msgspec ``tag=True``); the bracketed keys are left out when
they hold their default (``omit_defaults``). Before 2026 the events were arrays too
(``array_like=True``): ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]`` with trailing defaults
left out, and the oldest senders stop after ``lora_id``. The decoder reads both, ignores fields and
event types it does not know (an unknown event is counted in :attr:`EventBatch.unknown`), and raises
:class:`KvWireError` for anything else: whatever the bytes, nothing else escapes.

A block hash is an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default) or the raw sha256 bytes;
bytes become the int vLLM's own ``maybe_convert_block_hash`` makes of them (big-endian, low 64 bits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from llmgw_common.errors import BadMessage

# A payload larger than this is refused before unpacking: vLLM's batches are one scheduler step's
# events, kilobytes; this bounds what a hostile or broken sender can make a decoder allocate.
MAX_PAYLOAD = 16 * 1024 * 1024
# extra_keys nest (``(mm_id, offset)`` pairs inside a block's tuple); deeper than this is not vLLM.
_MAX_EXTRA_DEPTH = 4
_MASK64 = (1 << 64) - 1
_TOKEN_LIMIT = 1 << 32  # llmgw's block keys pack token ids as unsigned 32-bit integers


class KvWireError(BadMessage):
    """Frames that are not a vLLM KV-event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    # One entry per block (or None for the whole event): the LoRA name, multimodal
    # ``(identifier, offset)`` pairs, the request's cache_salt (a str), prompt-embedding digests.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    medium: str | None = None
    # The window of a sliding-window group (Gemma 3's local layers: 512), as vLLM 0.32 reports it.
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    group_idx: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    # Events of a type this module does not know, skipped (a newer vLLM); never encoded.
    unknown: int = 0


# ---------------------------------------------------------------- encoding


def _stored_map(e: BlockStored) -> dict[str, Any]:
    # Key order and presence as msgspec writes vLLM 0.32's struct: every field without a default
    # (lora_id is vLLM's deprecated one, always nil from its scheduler), then those with one only
    # when not nil.
    m: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(e.block_hashes),
        "parent_block_hash": e.parent_block_hash,
        "token_ids": list(e.token_ids),
        "block_size": e.block_size,
        "lora_id": None,
        "medium": e.medium,
        "lora_name": e.lora_name,
    }
    if e.extra_keys is not None:
        m["extra_keys"] = [None if k is None else list(k) for k in e.extra_keys]
    if e.group_idx is not None:
        m["group_idx"] = e.group_idx
    if e.kv_cache_spec_kind is not None:
        m["kv_cache_spec_kind"] = e.kv_cache_spec_kind
    if e.kv_cache_spec_sliding_window is not None:
        m["kv_cache_spec_sliding_window"] = e.kv_cache_spec_sliding_window
    return m


def _event_map(e: KvEvent) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        return _stored_map(e)
    if isinstance(e, BlockRemoved):
        m: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
        if e.group_idx is not None:
            m["group_idx"] = e.group_idx
        return m
    return {"type": "AllBlocksCleared"}


def encode_payload(batch: EventBatch) -> bytes:
    """The msgpack payload vLLM 0.32 writes for ``batch`` (floats as float64, as msgspec does)."""
    body = [float(batch.ts), [_event_map(e) for e in batch.events], batch.dp_rank]
    out: bytes = msgpack.packb(body, use_bin_type=True, use_single_float=False)
    return out


def encode_frames(topic: str, seq: int, batch: EventBatch) -> list[bytes]:
    """The three frames vLLM 0.32's ZMQ publisher sends for batch number ``seq``."""
    if not 0 <= seq <= _MASK64:
        raise ValueError(f"seq must fit 8 unsigned bytes, not {seq}")
    return [topic.encode(), seq.to_bytes(8, "big"), encode_payload(batch)]


# ---------------------------------------------------------------- decoding


def decode_frames(frames: Sequence[bytes]) -> tuple[str, int, EventBatch]:
    """``(topic, seq, batch)`` of one ZMQ message, or :class:`KvWireError`."""
    if len(frames) != 3:
        raise KvWireError(f"a KV-event message has 3 frames, not {len(frames)}")
    topic_b, seq_b, payload = (bytes(f) for f in frames)
    try:
        topic = topic_b.decode()
    except UnicodeDecodeError as e:
        raise KvWireError("topic frame is not utf-8") from e
    if len(seq_b) != 8:
        raise KvWireError(f"sequence frame has {len(seq_b)} bytes, not 8")
    return topic, int.from_bytes(seq_b, "big"), decode_payload(payload)


def decode_payload(payload: bytes) -> EventBatch:
    if len(payload) > MAX_PAYLOAD:
        raise KvWireError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError, MemoryError) as e:
        # msgpack's errors (ExtraData, FormatError, StackError, UnicodeDecodeError) are ValueErrors.
        raise KvWireError(f"payload is not msgpack: {type(e).__name__}") from e
    if not isinstance(raw, list) or len(raw) < 2:
        raise KvWireError("payload is not an array [ts, events, dp_rank]")
    ts, events_raw = raw[0], raw[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KvWireError(f"ts is {type(ts).__name__}, not a number")
    if not isinstance(events_raw, list):
        raise KvWireError(f"events is {type(events_raw).__name__}, not an array")
    dp_rank = _opt_int(raw[2] if len(raw) > 2 else None, "data_parallel_rank")
    events: list[KvEvent] = []
    unknown = 0
    for item in events_raw:
        ev = _event(item)
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    return EventBatch(ts=float(ts), events=tuple(events), dp_rank=dp_rank, unknown=unknown)


# Positions of the legacy array form, after the tag.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _event(item: object) -> KvEvent | None:
    if isinstance(item, Mapping):
        tag = item.get("type")
    elif isinstance(item, list) and item:
        tag = item[0]
    else:
        raise KvWireError(f"an event is {type(item).__name__}, not a map or tagged array")
    if not isinstance(tag, str):
        raise KvWireError("an event has no type tag")
    if isinstance(item, Mapping):
        fields: Mapping[Any, Any] = item
    else:
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
        fields = dict(zip(names, item[1:], strict=False))
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields.get("block_hashes"), "block_hashes"),
            group_idx=_opt_int(fields.get("group_idx"), "group_idx"),
            medium=_opt_str(fields.get("medium"), "medium"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _stored(f: Mapping[Any, Any]) -> BlockStored:
    if "token_ids" not in f or "block_size" not in f:
        raise KvWireError("BlockStored without token_ids or block_size")
    block_size = f["block_size"]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise KvWireError(f"BlockStored.block_size is {block_size!r}")
    tokens = f["token_ids"]
    if not isinstance(tokens, list):
        raise KvWireError("BlockStored.token_ids is not an array")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < _TOKEN_LIMIT:
            raise KvWireError(f"BlockStored.token_ids holds {t!r}")
    parent = f.get("parent_block_hash")
    return BlockStored(
        block_hashes=_hashes(f.get("block_hashes"), "block_hashes"),
        parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=_extra_keys(f.get("extra_keys")),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        medium=_opt_str(f.get("medium"), "medium"),
        kv_cache_spec_sliding_window=_opt_int(
            f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
        ),
    )


def _hash(v: object, what: str) -> int:
    if isinstance(v, bytes):
        # vLLM's maybe_convert_block_hash: the sha256 bytes as a big-endian int, low 64 bits.
        return int.from_bytes(v, "big") & _MASK64
    if isinstance(v, bool) or not isinstance(v, int):
        raise KvWireError(f"{what} holds {type(v).__name__}, not an int or bytes")
    return v


def _hashes(v: object, what: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise KvWireError(f"{what} is {type(v).__name__}, not an array")
    return tuple(_hash(h, what) for h in v)


def _opt_int(v: object, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise KvWireError(f"{what} is {type(v).__name__}, not an int")
    return v


def _opt_str(v: object, what: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise KvWireError(f"{what} is {type(v).__name__}, not a string")


def _frozen(v: object, depth: int) -> object:
    if isinstance(v, list):
        if depth >= _MAX_EXTRA_DEPTH:
            raise KvWireError("extra_keys nest too deep")
        return tuple(_frozen(x, depth + 1) for x in v)
    if isinstance(v, dict):
        raise KvWireError("extra_keys hold a map")
    return v


def _extra_keys(v: object) -> tuple[tuple[Any, ...] | None, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise KvWireError("extra_keys is not an array")
    out: list[tuple[Any, ...] | None] = []
    for k in v:
        if k is None:
            out.append(None)
        elif isinstance(k, list):
            out.append(tuple(_frozen(x, 1) for x in k))
        else:
            raise KvWireError("an extra_keys entry is not an array")
    return tuple(out)
