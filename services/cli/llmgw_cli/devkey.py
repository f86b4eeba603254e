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
from llmgw_runtime.apikeys import create_key, find_named, hash_key, revoke_key

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
    # By the name index (a get or two), not a read of every key (issue 35).
    live = await find_named(kv, prefix, DEV_KEY_NAME)
    old = read_key_file(key_file)
    if old is not None and live is not None and live.hash == hash_key(old) and record_valid(live, old, now):
        return old, False
    if live is not None:
        await revoke_key(kv, prefix, live.id)
    key, _ = await create_key(kv, prefix, DEV_KEY_NAME, now=now)
    write_key_file(key_file, key)
    return key, True
