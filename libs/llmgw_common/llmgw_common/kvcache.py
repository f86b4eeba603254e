"""The KV-cache index's contract: block keys, the deltas agents relay, the snapshots they answer.

An engine with prefix caching keeps its KV cache in blocks of ``block_size`` tokens; a block is reused
by a later request only when every token before it, and its own, are the same. Engines name blocks by
their own hashes (vLLM: sha256 of pickle or CBOR, seeded by ``PYTHONHASHSEED``, with extra keys for
LoRA, multimodal inputs and ``cache_salt``). llmgw does not copy that function: the agent beside each
engine reads the token ids that every ``BlockStored`` event carries and names each block by
:func:`chain_key` over them, and a router names a request's blocks by the same function over the
tokens it predicts. So one key means one token prefix whichever engine or version computed it, and a
change in an engine's own hashing cannot silently empty the index.

A *salt* (a tenant kept from sharing cached prefixes, an adapter's name) enters the first block's
parent (:func:`root_key`): two salts never share a key.

On the bus (``docs/bus.md``): an agent publishes :class:`KvDeltas` on ``<prefix>.node.<node>.kv``
(batched, at most one message per tick per node, never one per block) and answers
:class:`KvSnapshotRequest` on ``<prefix>.node.<node>.kv-snapshot`` with :class:`KvSnapshot` pages.
A router that sees a gap in a node's ``seq`` (or a new ``stream``) asks that node for a snapshot.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from enum import StrEnum

from pydantic import Field

from llmgw_common.catalog import CacheRouting
from llmgw_common.errors import InvalidInput
from llmgw_common.messages import Message

__all__ = ["CacheRouting"]  # the catalog's switch, kept there (messages import the catalog)

# The parent of a conversation's first block when no salt applies: a fixed constant, the same in every
# process (Python's own ``hash`` of a str is salted per process and may never be used for keys).
ROOT_KEY = 0x6C6C6D67775F6B76  # "llmgw_kv"
_MASK64 = (1 << 64) - 1
# A key list larger than this in one message is split (keeps a message well under NATS' 1 MiB).
MAX_KEYS_PER_MESSAGE = 60_000


class TokenizerKind(StrEnum):
    # A Hugging Face tokenizer (tokenizer.json) and its chat template, from the model's directory.
    HF = "hf"
    # The simulator's own tokenizer (llmgw_common.simtokens): whitespace-separated words, ids by hash.
    SIM = "sim"


def root_key(salt: str | None = None) -> int:
    """The parent key of a request's first block: :data:`ROOT_KEY`, or one derived from ``salt``."""
    if not salt:
        return ROOT_KEY
    d = hashlib.blake2b(salt.encode(), digest_size=8, person=b"llmgw-salt").digest()
    return int.from_bytes(d, "little")


def request_salt(adapter: str | None = None, cache_salt: str | None = None) -> str | None:
    """The salt of a request's blocks: its LoRA adapter's name and its ``cache_salt`` (vLLM puts both in
    its own block hashes and reports them in ``BlockStored.lora_name`` and the first block's
    ``extra_keys``), or None when it has neither."""
    if not adapter and not cache_salt:
        return None
    return f"{adapter or ''}\x1f{cache_salt or ''}"


# Salts the router sets for a key kept apart (``CacheScope``); a client's own ``cache_salt`` never may.
RESERVED_SALT_PREFIX = "llmgw:"


class SaltRefused(InvalidInput):
    """A client's ``cache_salt`` that would pass for one the router sets."""


def tenant_salt(scope: str, key_id: str, team: str | None, client_salt: str | None) -> str | None:
    """The ``cache_salt`` an engine gets for a request: the client's own for a shared key; for a key
    kept apart (``CacheScope`` team or key), one naming its team or itself, with the client's appended.
    A team scope without a team is kept to the key. Raises :class:`SaltRefused` for a client salt in
    the router's reserved namespace (it would let one tenant probe another's cached prefixes)."""
    if client_salt is not None and client_salt.startswith(RESERVED_SALT_PREFIX):
        raise SaltRefused(
            f"cache_salt values starting with {RESERVED_SALT_PREFIX!r} are reserved for the gateway"
        )
    if scope == "shared":
        return client_salt
    own = (
        f"{RESERVED_SALT_PREFIX}team:{team}"
        if scope == "team" and team
        else f"{RESERVED_SALT_PREFIX}key:{key_id}"
    )
    return own if not client_salt else f"{own}:{client_salt}"


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """The key of the block holding ``tokens`` after the block keyed ``parent``: 64 bits of BLAKE2b over
    the parent key and the token ids (as unsigned 32-bit integers, little-endian)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("I", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_keys(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The keys of every *full* block of ``tokens`` in order (a partial last block is never cached)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    out: list[int] = []
    parent = root_key(salt)
    packed = array("I", tokens).tobytes()
    width = 4 * block_size
    for end in range(width, len(packed) + 1, width):
        h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(packed[end - width : end])
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


# ---------------------------------------------------------------- on the bus


class ReplicaKv(Message):
    """What changed in one replica's KV cache since the agent's last batch, in llmgw's block keys."""

    replica: str
    model: str
    block_size: int = Field(ge=1)
    # Every entry of this replica is gone before ``stored`` applies (engine restarted, cache reset,
    # events lost: the agent starts the replica's set anew rather than leave a wrong entry).
    cleared: bool = False
    # The replica no longer runs on this node (stopped, evicted, scaled to zero): drop it whole.
    gone: bool = False
    stored: list[int] = Field(default_factory=list)
    removed: list[int] = Field(default_factory=list)


class KvDeltas(Message):
    """Agent -> routers on ``Subjects.kv(node)``: one batch of changes, at most one a tick."""

    node: str
    # The agent process's boot id: a new one restarts ``seq``.
    stream: str
    # One more per batch of this stream; a receiver that sees a gap asks for a snapshot.
    seq: int = Field(ge=1)
    sent_at: float
    replicas: list[ReplicaKv] = Field(default_factory=list)


class KvSnapshotRequest(Message):
    """Router -> agent on ``Subjects.kv_snapshot(node)``: the node's block sets, page by page. The first
    request names no replica; each reply names where the next page starts."""

    replica: str | None = None
    offset: int = Field(default=0, ge=0)


class KvSnapshot(Message):
    """One page of a node's block sets, consistent with delta ``seq`` of ``stream``: apply the deltas
    after ``seq`` on top. A replica listed with ``offset`` 0 replaces what the receiver held of it."""

    node: str
    stream: str
    seq: int = Field(ge=0)
    sent_at: float
    # The replicas running on the node with events (the whole list on every page): a receiver drops
    # those of this node it holds and that are not listed.
    running: list[str] = Field(default_factory=list)
    replicas: list[ReplicaKv] = Field(default_factory=list)
    # Where the next page starts (ask again with these), or None: this was the last.
    next_replica: str | None = None
    next_offset: int = 0


class TokenizerInfo(Message):
    """What a router needs to tokenize a model's requests as its engine does; kept in the object store
    ``Subjects.bucket_tokenizers`` under the model's name, beside the files of an HF tokenizer."""

    model: str
    kind: TokenizerKind
    # The model directory's files the agent put beside this record (tokenizer.json, its config, the
    # chat template), by name -> sha256; empty for the simulator's.
    files: dict[str, str] = Field(default_factory=dict)
    published_at: float = 0.0
