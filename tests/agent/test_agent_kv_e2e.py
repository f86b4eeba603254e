"""End to end: a real nats-server, a real agent, the simulated engine publishing vLLM's KV events.

The agent starts the simulator with a KV-event socket in the shard's run directory, follows it, and
relays llmgw block keys: those of the request's prompt as a router predicts them (the simulator's own
tokenizer, ``llmgw_common.simtokens``). A snapshot answers the same; unassigning the replica makes it
``gone``.
"""

from __future__ import annotations

import asyncio
import io
import zipfile
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import ObjectNotFoundError

from llmgw_agent.service import serve
from llmgw_agent.settings import AgentSettings
from llmgw_agent.tokenizer_store import INFO_ENTRY
from llmgw_common.codec import decode, encode
from llmgw_common.kvcache import (
    KvSnapshot,
    KvSnapshotRequest,
    TokenizerInfo,
    TokenizerKind,
    block_keys,
)
from llmgw_common.messages import Assignment, ShardAssignment, ShardState
from llmgw_common.simtokens import prompt_token_ids
from llmgw_common.subjects import Subjects
from llmgw_runtime.bus import ensure_kv, ensure_object_store
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import fake_collect, free_port, shard_of, watch_node
from tests.kit.kvtap import KvTap
from tests.kit.poll import eventually

pytestmark = pytest.mark.e2e
BS = 4


async def test_agent_relays_the_simulators_kv_events(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    node = "n1"
    s = AgentSettings(
        node=node,
        nats_urls=[nats_server.url],
        prefix=prefix,
        state_dir=str(tmp_path / "agent"),
        simulate_engines=True,
        heartbeat_interval_s=0.3,
        load_interval_s=0.2,
        stop_grace_s=2.0,
    )
    subjects = Subjects(prefix)
    seen = await watch_node(nc, prefix, node)
    tap = await KvTap.on(nc, prefix, node)
    kv = await ensure_kv(nc.jetstream(), subjects.bucket_assign)
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(s, stop, collect=fake_collect))
    port = free_port()

    held = tap.held

    try:
        shard = ShardAssignment(
            replica_id="rs",
            shard=0,
            model="ms",
            engine="sim",
            port=port,
            options={"ttft_ms": 1, "block_size": BS},
        )
        await kv.put(node, encode(Assignment(node=node, fence=1, shards=(shard,))))
        await seen.wait(
            "heartbeat", lambda h: (x := shard_of(h, "rs")) is not None and x.state is ShardState.READY
        )
        sock = tmp_path / "agent" / "run" / "rs-0" / "kv.sock"
        assert sock.exists(), "the simulator binds its KV-event socket in the shard's run directory"

        words = " ".join(f"w{i}" for i in range(40))
        body = {"model": "ms", "messages": [{"role": "user", "content": words}], "max_tokens": 2}
        tokens = prompt_token_ids(body)
        assert tokens is not None and len(tokens) >= 4 * BS
        want = set(block_keys(tokens, BS))
        async with httpx.AsyncClient(timeout=10) as http:
            # The relay's SUB joins the PUB asynchronously: repeat the request until its blocks show.
            async def relayed() -> bool:
                if not want <= held().get("rs", set()):
                    r = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
                    r.raise_for_status()
                    await asyncio.sleep(0.3)
                return want <= held().get("rs", set())

            await eventually(relayed, timeout=20, what="the prompt's blocks relayed")
        entry = next(r for m in tap.deltas for r in m.replicas if r.replica == "rs" and r.stored)
        assert entry.model == "ms" and entry.block_size == BS

        # The ready replica's tokenizer is in the object store: the simulator's, no files.
        store = await ensure_object_store(nc.jetstream(), subjects.bucket_tokenizers)

        async def tokenizer() -> TokenizerInfo | None:
            try:
                data = (await store.get("ms")).data
            except ObjectNotFoundError:
                return None
            assert data is not None
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                return decode(z.read(INFO_ENTRY), TokenizerInfo)

        info = await eventually(tokenizer, timeout=10, what="the tokenizer put")
        assert info.kind is TokenizerKind.SIM and info.model == "ms" and info.files == {}

        reply = await nc.request(subjects.kv_snapshot(node), encode(KvSnapshotRequest()), timeout=5)
        snap = decode(reply.data, KvSnapshot)
        assert snap.running == ["rs"] and want <= set(snap.replicas[0].stored)

        await kv.put(node, encode(Assignment(node=node, fence=1, shards=())))
        await eventually(
            lambda: any(r.gone for m in tap.deltas for r in m.replicas if r.replica == "rs"),
            timeout=20,
            what="the replica announced gone",
        )
        assert "rs" not in held()
    finally:
        stop.set()
        await asyncio.wait_for(agent, 30)
