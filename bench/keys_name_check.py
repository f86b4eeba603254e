"""What `llmgw keys create` takes in to check a name, by the number of keys (issue 35).

One nats-server; N key records stored as the CLI stores them (raw publish), one create to index them (the
first use after the upgrade does), then a second create timed on its own connection, its bytes in counted.
``--module PATH`` loads another ``apikeys.py`` (the one before the name index:
``git show c19bd19:libs/llmgw_runtime/llmgw_runtime/apikeys.py > /tmp/apikeys_old.py``) to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import tempfile
import time
from pathlib import Path
from types import ModuleType

import nats

from llmgw_common.codec import encode
from llmgw_common.messages import ApiKeyRecord
from llmgw_runtime import apikeys, bus
from llmgw_runtime.natsserver import NatsServer


def _load(path: str | None) -> ModuleType:
    if path is None:
        return apikeys
    spec = importlib.util.spec_from_file_location("apikeys_other", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def _fill(nc: nats.NATS, bucket: str, n: int) -> None:
    await bus.ensure_kv(nc.jetstream(), bucket)
    for i in range(n):
        rec = ApiKeyRecord(id=f"k{i}", name=f"key {i}", hash=f"{i:064x}", created=1.0)
        await nc.publish(f"$KV.{bucket}.k{i}", encode(rec))
    await nc.flush()
    while (await nc.jetstream().stream_info(f"KV_{bucket}")).state.messages < n:
        await asyncio.sleep(0.1)


async def main(sizes: list[int], mod: ModuleType) -> None:
    srv = NatsServer(Path(tempfile.mkdtemp()))
    srv.start()
    try:
        nc = await nats.connect(srv.url)
        for n in sizes:
            prefix = f"c{n}"
            await _fill(nc, f"{prefix}_keys", n)
            await mod.create_key(nc, prefix, "first")
            conn = await nats.connect(srv.url)
            await mod.create_key(conn, prefix, "warm")
            b0, t0 = conn.stats["in_bytes"], time.perf_counter()
            await mod.create_key(conn, prefix, "second")
            ms = (time.perf_counter() - t0) * 1000
            print(f"{n:>7} keys: create {ms:8.1f} ms, {conn.stats['in_bytes'] - b0:>9} bytes in")
            await conn.close()
        await nc.close()
    finally:
        srv.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--module", help="another apikeys.py to measure instead")
    a = ap.parse_args()
    asyncio.run(main([int(x) for x in a.sizes.split(",")], _load(a.module)))
