"""The development key of `llmgw up`: minted once, reused while valid, replaced when not."""

from __future__ import annotations

import stat
from pathlib import Path

from nats.aio.client import Client as NATS

from llmgw_cli.devkey import DEV_KEY_NAME, ensure_dev_key
from llmgw_common.codec import encode
from llmgw_common.subjects import Subjects
from llmgw_runtime.apikeys import hash_key, list_keys, revoke_key
from llmgw_runtime.bus import ensure_kv


async def test_minted_once_then_reused(nc: NATS, prefix: str, tmp_path: Path) -> None:
    kv = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_keys)
    f = tmp_path / "dev-key"
    key, minted = await ensure_dev_key(kv, prefix, f)
    assert minted
    assert f.read_text().strip() == key
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    (rec,) = await list_keys(kv, prefix)
    assert rec.name == DEV_KEY_NAME and rec.hash == hash_key(key) and key not in encode(rec).decode("latin-1")

    again, minted = await ensure_dev_key(kv, prefix, f)
    assert (again, minted) == (key, False)
    assert len(await list_keys(kv, prefix)) == 1


async def test_revoked_or_expired_key_is_replaced(nc: NATS, prefix: str, tmp_path: Path) -> None:
    kv = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_keys)
    f = tmp_path / "dev-key"
    first, _ = await ensure_dev_key(kv, prefix, f, now=1000.0)
    (rec,) = await list_keys(kv, prefix)
    await revoke_key(kv, prefix, rec.id)
    second, minted = await ensure_dev_key(kv, prefix, f)
    assert minted and second != first
    assert f.read_text().strip() == second

    (rec2,) = [r for r in await list_keys(kv, prefix) if not r.revoked]
    await kv.put(rec2.id, encode(rec2.model_copy(update={"expires": 1.0})))
    third, minted = await ensure_dev_key(kv, prefix, f)
    assert minted and third not in (first, second)


async def test_lost_key_file_revokes_the_old_dev_key(nc: NATS, prefix: str, tmp_path: Path) -> None:
    kv = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_keys)
    f = tmp_path / "dev-key"
    first, _ = await ensure_dev_key(kv, prefix, f)
    f.unlink()
    second, minted = await ensure_dev_key(kv, prefix, f)
    assert minted and second != first
    recs = {r.hash: r for r in await list_keys(kv, prefix)}
    assert recs[hash_key(first)].revoked
    assert not recs[hash_key(second)].revoked
