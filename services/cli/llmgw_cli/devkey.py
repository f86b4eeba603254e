"""The development API key of ``llmgw up``: minted on the first run, reused while its record is valid.

The key itself lives only in ``<data-dir>/dev-key`` (mode 0600); the bus holds its record (the
sha256, never the key) in ``<prefix>_keys``, like any key ``llmgw keys create`` makes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from pathlib import Path

from nats.js.kv import KeyValue

from llmgw_common.bus import kv_get, kv_keys
from llmgw_common.codec import encode
from llmgw_common.messages import ApiKeyRecord

DEV_KEY_ID = "dev"
DEV_KEY_NAME = "llmgw up development key"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def record_valid(rec: ApiKeyRecord | None, key: str, now: float) -> bool:
    """Whether ``rec`` still admits ``key``: same hash, not revoked, not expired, every model allowed."""
    return (
        rec is not None
        and rec.hash == key_hash(key)
        and not rec.revoked
        and (rec.expires is None or rec.expires > now)
        and rec.models is None
    )


def read_key_file(path: Path) -> str | None:
    try:
        key = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return key or None


def write_key_file(path: Path, key: str) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key + "\n")
    os.replace(tmp, path)


async def find_record(kv: KeyValue, key: str) -> ApiKeyRecord | None:
    """The record in the bucket whose hash is the key's, or None."""
    want = key_hash(key)
    for k in await kv_keys(kv):
        rec, _ = await kv_get(kv, k, ApiKeyRecord)
        if rec is not None and rec.hash == want:
            return rec
    return None


async def ensure_dev_key(kv: KeyValue, key_file: Path, *, now: float | None = None) -> tuple[str, bool]:
    """The development key: the one in ``key_file`` if its record is valid, else a new one.

    Returns ``(key, minted)``. A new key replaces the record ``dev`` and is written to ``key_file``.
    """
    now = time.time() if now is None else now
    old = read_key_file(key_file)
    if old is not None and record_valid(await find_record(kv, old), old, now):
        return old, False
    key = "sk-llmgw-" + secrets.token_urlsafe(32)
    rec = ApiKeyRecord(id=DEV_KEY_ID, name=DEV_KEY_NAME, hash=key_hash(key), created=now)
    await kv.put(DEV_KEY_ID, encode(rec))
    write_key_file(key_file, key)
    return key, True
