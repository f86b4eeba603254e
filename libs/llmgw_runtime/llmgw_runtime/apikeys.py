"""API keys as the bus holds them: minting, hashing, and the records in ``<prefix>_keys``.

A key is shown once, when it is made; the bucket holds only its sha256 (hex). ``llmgw keys`` and
``llmgw up`` write the records here; routers follow the bucket (``llmgw_router.keys``).

Names are unique among live keys. They are checked by a name index, the bucket ``<prefix>_key_names``
(issue 35): the key ``<sha256 of the name>`` holds the id of the key that took the name, written
create-only, so two keys made at once cannot both take it, and checking a name is one get whatever the
number of keys (it was a read of every key: 4-9 s at 10,000 keys, and JetStream's answer listing 100,000
keys was the bus's largest message, ~2.9 MB). A bucket of its own: routers, which follow ``<prefix>_keys``,
never see it. An entry whose key was revoked (or never written: a create that died between the two
writes) is stale and taken over. Keys made before the index are indexed once, by the first create or
lookup by name that finds no ``indexed`` mark: the last read of every key.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
import time
from collections.abc import Iterable
from typing import Any

from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from llmgw_common.codec import encode
from llmgw_common.errors import InvalidInput
from llmgw_common.messages import TEAM_KEY_PREFIX, ApiKeyRecord, CacheScope, KeyLimits, TeamRecord
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus

KEY_PREFIX = "llmgw-"
# In the name index, once every key made before it is in it.
INDEXED_MARK = "indexed"
# What a KV key may hold: a key id or name outside it is no key of the bucket.
_KV_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")


def generate_key() -> str:
    """A new API key: ``llmgw-`` and 32 random bytes, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key_id() -> str:
    return "k-" + secrets.token_hex(6)


class KeyOpError(InvalidInput):
    """A key operation that cannot be done, said in the operator's terms."""


async def _keys_kv(nc_or_kv: Any, prefix: str) -> KeyValue:
    if isinstance(nc_or_kv, KeyValue):
        return nc_or_kv
    return await bus.ensure_kv(nc_or_kv.jetstream(), Subjects(prefix).bucket_keys)


async def _names_kv(keys: KeyValue, prefix: str) -> KeyValue:
    """The name index, made beside the keys bucket with its replica count when it does not exist."""
    js = keys._js
    try:
        return await js.key_value(Subjects(prefix).bucket_key_names)
    except BucketNotFoundError:
        replicas = (await keys.status()).stream_info.config.num_replicas or 1
    return await bus.ensure_kv(js, Subjects(prefix).bucket_key_names, replicas=replicas)


async def create_key(
    nc_or_kv: Any,
    prefix: str,
    name: str,
    models: Iterable[str] | None = None,
    expires: float | None = None,
    *,
    now: float | None = None,
    limits: KeyLimits | None = None,
    team: str | None = None,
    weight: float = 1.0,
    cache_scope: CacheScope = CacheScope.SHARED,
) -> tuple[str, ApiKeyRecord]:
    """Mint a key, store its record (hash only) in ``<prefix>_keys``; return (key, record).

    ``nc_or_kv``: a connected NATS client or the keys bucket. ``expires``: UNIX time or None.
    A name already used by a key that is not revoked is refused, so names can address keys.
    """
    kv = await _keys_kv(nc_or_kv, prefix)
    names = await _ensure_index(kv, prefix)
    key = generate_key()
    rec = ApiKeyRecord(
        id=new_key_id(),
        name=name,
        hash=hash_key(key),
        models=tuple(models) if models is not None else None,
        created=time.time() if now is None else now,
        expires=expires,
        limits=limits,
        team=team,
        weight=weight,
        cache_scope=cache_scope,
    )
    entry = name_key(name)
    try:
        await names.create(entry, rec.id.encode())
    except KeyWrongLastSequenceError:
        held, revision = await _named(kv, names, name)
        if held is not None:
            raise KeyOpError(
                f"a key named {name!r} already exists (id {held.id}); revoke it or pick another name"
            ) from None
        try:
            await names.update(entry, rec.id.encode(), last=revision)  # a stale entry: taken over
        except KeyWrongLastSequenceError:
            raise KeyOpError(f"another key named {name!r} is being made at this moment; try again") from None
    await kv.create(rec.id, encode(rec))
    return key, rec


def name_key(name: str) -> str:
    """The name index's key of ``name`` (any text: hashed into what a KV key may hold)."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:40]


async def _named(kv: KeyValue, names: KeyValue, name: str) -> tuple[ApiKeyRecord | None, int]:
    """The live key named ``name`` by the index (None: none), and its entry's revision (0: no entry)."""
    try:
        e = await names.get(name_key(name))
    except NotFoundError:  # absent or deleted
        return None, 0
    if e.value is None:
        return None, 0
    rec, _ = await bus.kv_get(kv, e.value.decode("utf-8", "replace"), ApiKeyRecord)
    if rec is None or rec.revoked or rec.name != name:
        return None, e.revision or 0
    return rec, e.revision or 0


async def find_named(nc_or_kv: Any, prefix: str, name: str) -> ApiKeyRecord | None:
    """The live key named ``name``, by the name index: a get or two, whatever the number of keys."""
    kv = await _keys_kv(nc_or_kv, prefix)
    names = await _ensure_index(kv, prefix)
    return (await _named(kv, names, name))[0]


async def _ensure_index(kv: KeyValue, prefix: str) -> KeyValue:
    """The name index; keys made before it indexed once, by one read of every key (the last such read)."""
    names = await _names_kv(kv, prefix)
    try:
        await names.get(INDEXED_MARK)
        return names
    except NotFoundError:
        pass
    for rec in await list_keys(kv):
        if not rec.revoked:
            # Two live keys of one name (made before names were unique): the first made keeps it.
            with contextlib.suppress(KeyWrongLastSequenceError):
                await names.create(name_key(rec.name), rec.id.encode())
    await names.put(INDEXED_MARK, b"1")
    return names


async def list_keys(nc_or_kv: Any, prefix: str = "llmgw") -> list[ApiKeyRecord]:
    kv = await _keys_kv(nc_or_kv, prefix)
    out: list[ApiKeyRecord] = []
    for k in await bus.kv_keys(kv):
        if k.startswith(TEAM_KEY_PREFIX):
            continue
        rec, _ = await bus.kv_get(kv, k, ApiKeyRecord)
        if rec is not None:
            out.append(rec)
    out.sort(key=lambda r: r.created)
    return out


async def _find(kv: KeyValue, prefix: str, id_or_name: str) -> ApiKeyRecord:
    """The key of this id, else the live key of this name: a get or two, whatever the number of keys."""
    if _KV_KEY.match(id_or_name) and not id_or_name.startswith(TEAM_KEY_PREFIX):
        rec, _ = await bus.kv_get(kv, id_or_name, ApiKeyRecord)
        if rec is not None:
            return rec
    names = await _ensure_index(kv, prefix)
    rec, _ = await _named(kv, names, id_or_name)
    if rec is None:
        raise KeyOpError(f"no key with id or name {id_or_name!r}")
    return rec


async def revoke_key(nc_or_kv: Any, prefix: str, id_or_name: str) -> ApiKeyRecord:
    """Mark a key revoked, by id or by name (a name must match exactly one key not yet revoked)."""
    kv = await _keys_kv(nc_or_kv, prefix)
    rec = (await _find(kv, prefix, id_or_name)).model_copy(update={"revoked": True})
    await kv.put(rec.id, encode(rec))
    return rec


_UNSET: Any = object()


async def update_key(
    nc_or_kv: Any,
    prefix: str,
    id_or_name: str,
    *,
    limits: KeyLimits | None = _UNSET,
    team: str | None = _UNSET,
    weight: float | None = None,
    cache_scope: CacheScope | None = None,
) -> ApiKeyRecord:
    """Change a key's limits, team, weight or cache scope (what is not given stays). Routers follow the bucket, so
    the change holds on every router within a tick. Validated as a whole record before it is written."""
    kv = await _keys_kv(nc_or_kv, prefix)
    old = await _find(kv, prefix, id_or_name)
    if old.revoked:
        raise KeyOpError(f"key {old.id} ({old.name}) is revoked")
    data = old.model_dump()
    if limits is not _UNSET:
        data["limits"] = limits.model_dump() if limits is not None else None
    if team is not _UNSET:
        data["team"] = team
    if weight is not None:
        data["weight"] = weight
    if cache_scope is not None:
        data["cache_scope"] = cache_scope
    rec = ApiKeyRecord.model_validate(data)
    await kv.put(rec.id, encode(rec))
    return rec


def team_key(name: str) -> str:
    return TEAM_KEY_PREFIX + name


async def put_team(nc_or_kv: Any, prefix: str, team: TeamRecord) -> TeamRecord:
    """Create or replace a team's limits (shared by every key whose ``team`` is its name)."""
    if not team.name or not all(c.isalnum() or c in "-_" for c in team.name):
        raise KeyOpError(f"team name {team.name!r}: use letters, digits, '-' and '_'")
    kv = await _keys_kv(nc_or_kv, prefix)
    await kv.put(team_key(team.name), encode(team))
    return team


async def list_teams(nc_or_kv: Any, prefix: str = "llmgw") -> list[TeamRecord]:
    kv = await _keys_kv(nc_or_kv, prefix)
    out: list[TeamRecord] = []
    for k in await bus.kv_keys(kv):
        if k.startswith(TEAM_KEY_PREFIX):
            rec, _ = await bus.kv_get(kv, k, TeamRecord)
            if rec is not None:
                out.append(rec)
    out.sort(key=lambda t: t.name)
    return out
