"""Key names checked by the name index (issue 35): what `llmgw keys create` reads to check a name does not
grow with the number of keys (it was every key: 4-9 s at 10,000, and a 2.9 MB JetStream answer listing
100,000); keys made before the index are still found by name, and a name is never taken twice."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.messages import ApiKeyRecord
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.apikeys import (
    INDEXED_MARK,
    KeyOpError,
    create_key,
    find_named,
    list_keys,
    name_key,
    revoke_key,
    update_key,
)
from llmgw_runtime.natsserver import NatsServer
from tests.common.test_kv_follower_cost import _fill

pytestmark = pytest.mark.slow


async def _create_cost(nats_server: NatsServer, prefix: str, nc: NATS, n: int) -> int:
    """Bytes one `keys create` takes in, on its own connection, with ``n`` keys in the bucket (the
    index built already: once, by the first create after the upgrade)."""
    await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_keys)
    await _fill(nc, Subjects(prefix).bucket_keys, n)
    await create_key(nc, prefix, "first")  # indexes the n keys made before the index
    conn = await nats.connect(nats_server.url)
    try:
        await create_key(conn, prefix, "warm")  # the bucket's binding, as every CLI call makes it
        b0 = conn.stats["in_bytes"]
        await create_key(conn, prefix, "second")
        return int(conn.stats["in_bytes"] - b0)
    finally:
        await conn.close()


async def test_a_name_check_costs_the_same_whatever_the_number_of_keys(
    nats_server: NatsServer, prefix: str, nc: NATS
) -> None:
    small = await _create_cost(nats_server, prefix + "s", nc, 200)
    large = await _create_cost(nats_server, prefix + "l", nc, 2000)
    # A get of the name's entry and the writes' acks: a few hundred bytes at both sizes. A read of
    # every key was ~100 bytes a key (200 KB at 2,000).
    assert large < 1.5 * small and large < 3_000, (small, large)


async def test_keys_made_before_the_index_keep_their_names(prefix: str, nc: NATS) -> None:
    bucket = Subjects(prefix).bucket_keys
    kv = await bus.ensure_kv(nc.jetstream(), bucket)
    # As an older CLI wrote them: records alone, no index. "key 1" is revoked.
    await _fill(nc, bucket, 3)
    await kv.put("k1", encode(ApiKeyRecord(id="k1", name="key 1", hash="1" * 64, created=1.0, revoked=True)))
    with pytest.raises(KeyOpError, match="already exists \\(id k0\\)"):
        await create_key(nc, prefix, "key 0")
    names = await nc.jetstream().key_value(Subjects(prefix).bucket_key_names)
    assert (await names.get(INDEXED_MARK)).value == b"1"
    assert (await names.get(name_key("key 2"))).value == b"k2"
    # A revoked key's name is free again; by name, revoke and update find the live key.
    _, again = await create_key(nc, prefix, "key 1")
    assert (await find_named(kv, prefix, "key 1")) == again
    assert (await update_key(nc, prefix, "key 2", weight=2.0)).id == "k2"
    assert (await revoke_key(nc, prefix, "key 2")).revoked
    assert await find_named(kv, prefix, "key 2") is None
    with pytest.raises(KeyOpError, match="no key with id or name 'key 2'"):
        await revoke_key(nc, prefix, "key 2")
    # By id, a revoked key is still found; a name that is no KV key is looked up as a name only.
    assert (await revoke_key(nc, prefix, "k2")).id == "k2"
    with pytest.raises(KeyOpError, match="no key"):
        await revoke_key(nc, prefix, "nobody at all")
    # The index is a bucket of its own: the keys bucket, which routers follow, holds the records only.
    assert sorted(r.id for r in await list_keys(kv)) == sorted(["k0", "k1", "k2", again.id])
    assert sorted(await bus.kv_keys(kv)) == sorted(["k0", "k1", "k2", again.id])


async def test_a_stale_entry_is_taken_over_and_a_name_is_taken_once(prefix: str, nc: NATS) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_keys)
    # A create that died between its two writes: the entry names a key that was never written.
    await create_key(nc, prefix, "seed")
    names = await nc.jetstream().key_value(Subjects(prefix).bucket_key_names)
    await names.create(name_key("ghost"), b"k-never")
    _, rec = await create_key(nc, prefix, "ghost")
    assert (await names.get(name_key("ghost"))).value == rec.id.encode()
    # Ten creates of one name at once: one key takes it, the others are refused.
    results = await asyncio.gather(
        *(create_key(nc, prefix, "race") for _ in range(10)), return_exceptions=True
    )
    made = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, KeyOpError)]
    assert len(made) == 1 and len(refused) == 9, results
    assert [r.name for r in await list_keys(kv)].count("race") == 1
