"""API keys as the bus holds them: minting, hashing, and the records in ``<prefix>_keys``.

A key is shown once, when it is made; the bucket holds only its sha256 (hex). ``llmgw keys`` and
``llmgw up`` write the records here; routers follow the bucket (``llmgw_router.keys``).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterable
from typing import Any

from nats.js.kv import KeyValue

from llmgw_common.codec import encode
from llmgw_common.errors import InvalidInput
from llmgw_common.messages import TEAM_KEY_PREFIX, ApiKeyRecord, CacheScope, KeyLimits, TeamRecord
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus

KEY_PREFIX = "llmgw-"


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
        limits=limits,
        team=team,
        weight=weight,
        cache_scope=cache_scope,
    )
    await kv.create(rec.id, encode(rec))
    return key, rec


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


async def _find(kv: KeyValue, id_or_name: str, verb: str) -> ApiKeyRecord:
    recs = await list_keys(kv)
    match = [r for r in recs if r.id == id_or_name]
    if not match:
        match = [r for r in recs if r.name == id_or_name and not r.revoked]
    if not match:
        raise KeyOpError(f"no key with id or name {id_or_name!r}")
    if len(match) > 1:
        ids = ", ".join(r.id for r in match)
        raise KeyOpError(f"{len(match)} keys are named {id_or_name!r} ({ids}): {verb} by id")
    return match[0]


async def revoke_key(nc_or_kv: Any, prefix: str, id_or_name: str) -> ApiKeyRecord:
    """Mark a key revoked, by id or by name (a name must match exactly one key not yet revoked)."""
    kv = await _keys_kv(nc_or_kv, prefix)
    rec = (await _find(kv, id_or_name, "revoke")).model_copy(update={"revoked": True})
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
    old = await _find(kv, id_or_name, "update")
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
