"""API keys: generation, hashing, the records in ``<prefix>_keys`` and the router's in-memory table.

A key is shown once, when it is made; the bucket holds only its sha256 (hex). A router follows the
bucket and answers every check from memory, so a revoked or expired key stops working within one
watch event (and at worst one resync) on every router, with no bus call on the request path.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nats.js.kv import KeyValue

from llmgw_common import bus
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.messages import ApiKeyRecord
from llmgw_common.subjects import Subjects

KEY_PREFIX = "llmgw-"


def generate_key() -> str:
    """A new API key: ``llmgw-`` and 32 random bytes, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key_id() -> str:
    return "k-" + secrets.token_hex(6)


class KeyOpError(Exception):
    """A key operation that cannot be done, said in the operator's terms."""


@dataclass(frozen=True, slots=True)
class KeyCheck:
    """Outcome of checking a presented key: the record, or why it was refused (HTTP 401)."""

    record: ApiKeyRecord | None
    problem: str | None = None


class KeyTable:
    """hash -> record, fed from the bucket (or a static file). Reads are plain dict lookups."""

    def __init__(self, records: Iterable[ApiKeyRecord] = ()) -> None:
        self._by_id: dict[str, ApiKeyRecord] = {}
        self._by_hash: dict[str, ApiKeyRecord] = {}
        for r in records:
            self.put(r)

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, record: ApiKeyRecord) -> None:
        old = self._by_id.pop(record.id, None)
        if old is not None:
            self._by_hash.pop(old.hash, None)
        self._by_id[record.id] = record
        self._by_hash[record.hash] = record

    def remove(self, key_id: str) -> None:
        old = self._by_id.pop(key_id, None)
        if old is not None:
            self._by_hash.pop(old.hash, None)

    def check(self, key: str | None, now: float) -> KeyCheck:
        if not key:
            return KeyCheck(None, "no API key: send 'Authorization: Bearer <key>'")
        try:
            digest = hash_key(key)
        except UnicodeEncodeError:
            # aiohttp hands over header bytes that are not UTF-8 as surrogates; no key has them.
            return KeyCheck(None, "invalid API key: it is not valid UTF-8")
        rec = self._by_hash.get(digest)
        if rec is None:
            return KeyCheck(None, "invalid API key")
        if rec.revoked:
            return KeyCheck(None, f"API key {rec.name!r} was revoked")
        if rec.expires is not None and now >= rec.expires:
            return KeyCheck(None, f"API key {rec.name!r} has expired")
        return KeyCheck(rec)

    def on_kv_change(self, key: str, value: bytes | None, revision: int) -> None:
        """KvFollower callback: a record put, replaced or deleted. A bad value drops that key."""
        if value is None:
            self.remove(key)
            return
        try:
            rec = decode(value, ApiKeyRecord)
        except DecodeError:
            self.remove(key)
            raise
        if rec.id != key:
            rec = rec.model_copy(update={"id": key})
        self.put(rec)


def allows_model(record: ApiKeyRecord | None, model: str) -> bool:
    return record is None or record.models is None or model in record.models


# ---------------------------------------------------------------- bucket operations (CLI, llmgw up)


async def _keys_kv(nc_or_kv: Any, prefix: str) -> KeyValue:
    if isinstance(nc_or_kv, KeyValue):
        return nc_or_kv
    return await bus.ensure_kv(nc_or_kv.jetstream(), Subjects(prefix).bucket_keys)


async def create_key(
    nc_or_kv: Any,
    prefix: str,
    name: str,
    models: Iterable[str] | None = None,
    expires: float | None = None,
    *,
    now: float | None = None,
) -> tuple[str, ApiKeyRecord]:
    """Mint a key, store its record (hash only) in ``<prefix>_keys``; return (key, record).

    ``nc_or_kv``: a connected NATS client or the keys bucket. ``expires``: UNIX time or None.
    A name already used by a key that is not revoked is refused, so names can address keys.
    """
    kv = await _keys_kv(nc_or_kv, prefix)
    for rec in await list_keys(kv):
        if rec.name == name and not rec.revoked:
            raise KeyOpError(
                f"a key named {name!r} already exists (id {rec.id}); revoke it or pick another name"
            )
    key = generate_key()
    rec = ApiKeyRecord(
        id=new_key_id(),
        name=name,
        hash=hash_key(key),
        models=tuple(models) if models is not None else None,
        created=time.time() if now is None else now,
        expires=expires,
    )
    await kv.create(rec.id, encode(rec))
    return key, rec


async def list_keys(nc_or_kv: Any, prefix: str = "llmgw") -> list[ApiKeyRecord]:
    kv = await _keys_kv(nc_or_kv, prefix)
    out: list[ApiKeyRecord] = []
    for k in await bus.kv_keys(kv):
        rec, _ = await bus.kv_get(kv, k, ApiKeyRecord)
        if rec is not None:
            out.append(rec)
    out.sort(key=lambda r: r.created)
    return out


async def revoke_key(nc_or_kv: Any, prefix: str, id_or_name: str) -> ApiKeyRecord:
    """Mark a key revoked, by id or by name (a name must match exactly one key not yet revoked)."""
    kv = await _keys_kv(nc_or_kv, prefix)
    recs = await list_keys(kv)
    match = [r for r in recs if r.id == id_or_name]
    if not match:
        match = [r for r in recs if r.name == id_or_name and not r.revoked]
    if not match:
        raise KeyOpError(f"no key with id or name {id_or_name!r}")
    if len(match) > 1:
        ids = ", ".join(r.id for r in match)
        raise KeyOpError(f"{len(match)} keys are named {id_or_name!r} ({ids}): revoke by id")
    rec = match[0].model_copy(update={"revoked": True})
    await kv.put(rec.id, encode(rec))
    return rec
