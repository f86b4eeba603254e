"""The development API key of ``llmgw up``: minted on the first run, reused while its record is valid.

The key itself lives only in ``<data-dir>/dev-key`` (mode 0600); the bus holds its record (the
sha256, never the key) in ``<prefix>_keys``, like any key ``llmgw keys create`` makes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from nats.js.kv import KeyValue

from llmgw_common.messages import ApiKeyRecord
from llmgw_runtime.apikeys import create_key, hash_key, list_keys, revoke_key

DEV_KEY_NAME = "llmgw up development key"


def record_valid(rec: ApiKeyRecord | None, key: str, now: float) -> bool:
    """Whether ``rec`` still admits ``key``: same hash, not revoked, not expired, every model allowed."""
    return (
        rec is not None
        and rec.hash == hash_key(key)
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


async def ensure_dev_key(
    kv: KeyValue, prefix: str, key_file: Path, *, now: float | None = None
) -> tuple[str, bool]:
    """The development key: the one in ``key_file`` if its record is valid, else a new one.

    Returns ``(key, minted)``. A new key revokes any earlier development key whose file was lost
    (its name must stay unique) and is written to ``key_file``.
    """
    now = time.time() if now is None else now
    records = await list_keys(kv, prefix)
    old = read_key_file(key_file)
    if old is not None:
        want = hash_key(old)
        if any(record_valid(r, old, now) for r in records if r.hash == want):
            return old, False
    for r in records:
        if r.name == DEV_KEY_NAME and not r.revoked:
            await revoke_key(kv, prefix, r.id)
    key, _ = await create_key(kv, prefix, DEV_KEY_NAME, now=now)
    write_key_file(key_file, key)
    return key, True
