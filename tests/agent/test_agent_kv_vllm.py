"""A real agent relaying a real vLLM's KV events (gemma-3-270m on CPU, ``make vllm``).

The agent starts vLLM with the flags its adapter adds (prefix caching, KV events on ipc:// in the
shard's run directory, ``PYTHONHASHSEED=0``), follows the socket, and publishes llmgw block keys: those
must be ``block_keys`` over the prompt ids vLLM itself reports for the request (the full blocks), and
nothing of the sliding-window groups. The model's tokenizer is put in the object store as kind HF.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import ObjectNotFoundError

from llmgw_agent.engines import LaunchSpec, launch_spec
from llmgw_agent.kvrelay import Feed, KvRelay
from llmgw_agent.service import serve
from llmgw_agent.settings import AgentSettings
from llmgw_agent.tokenizer_store import INFO_ENTRY
from llmgw_common.codec import decode, encode
from llmgw_common.kvcache import TokenizerInfo, TokenizerKind, block_keys
from llmgw_common.messages import Assignment, ShardAssignment, ShardState
from llmgw_common.subjects import Subjects
from llmgw_runtime.bus import ensure_kv, ensure_object_store
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import fake_collect, free_port, shard_of, watch_node
from tests.kit.kvtap import KvTap
from tests.kit.poll import eventually
from tests.vllm.vllm_kit import BASE_ARGS, ONE_WORKER_ENV, READY_TIMEOUT_S, profile_env, require_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1500)]
BLOCK = 128


async def test_agent_relays_real_vllm_events_as_the_prompts_block_keys(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    install = require_vllm()
    node = "n1"
    s = AgentSettings(
        node=node,
        nats_urls=[nats_server.url],
        prefix=prefix,
        state_dir=str(tmp_path / "agent"),
        vllm=install.command_line,
        vllm_cpu=True,
        model_dirs=[str(install.gemma.parent)],
        heartbeat_interval_s=0.5,
        load_interval_s=0.5,
        stop_grace_s=10.0,
    )
    subjects = Subjects(prefix)
    seen = await watch_node(nc, prefix, node)
    tap = await KvTap.on(nc, prefix, node)
    kv = await ensure_kv(nc.jetstream(), subjects.bucket_assign)
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(s, stop, collect=fake_collect))
    port = free_port()

    def held() -> set[int]:
        return tap.held().get("rg", set())

    try:
        shard = ShardAssignment(
            replica_id="rg",
            shard=0,
            model="gemma",
            engine="vllm",
            weights=install.gemma.name,
            port=port,
            args=BASE_ARGS,
            env={**profile_env("0"), **ONE_WORKER_ENV},
            options={"device": "cpu"},
            startup_timeout_s=READY_TIMEOUT_S,
        )
        await kv.put(node, encode(Assignment(node=node, fence=1, shards=(shard,))))
        await seen.wait(
            "heartbeat",
            lambda h: (x := shard_of(h, "rg")) is not None and x.state is ShardState.READY,
            timeout=READY_TIMEOUT_S,
        )
        words = " ".join(f"harbor{i % 7} lantern{i % 5}" for i in range(80))
        body = {"model": "gemma", "messages": [{"role": "user", "content": words}], "max_tokens": 2}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            tok = await http.post("/tokenize", json={"model": "gemma", "messages": body["messages"]})
            tok.raise_for_status()
            ids: list[int] = tok.json()["tokens"]
            assert 2 * BLOCK <= len(ids) < 500, len(ids)  # two full blocks, within --max-model-len 512
            r = await http.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            assert r.json()["usage"]["prompt_tokens"] == len(ids)
        want = set(block_keys(ids, BLOCK))
        await eventually(lambda: want <= held(), timeout=30, what="the prompt's full blocks relayed")
        # At most one block more: one the output completed (prompt and generated tokens).
        assert len(held() - want) <= 1
        entry = next(r for m in tap.deltas for r in m.replicas if r.replica == "rg" and r.stored)
        assert entry.block_size == BLOCK and entry.model == "gemma"

        # An agent restarted beside this engine with nothing saved: vLLM replays what it keeps (from
        # batch 0 here), and that agent holds the same blocks without a request.
        spec = launch_spec(shard, s)
        assert isinstance(spec, LaunchSpec) and spec.kv_events is not None and spec.kv_events.replay
        later = KvRelay(nc, Subjects(prefix + "-later"), node, "boot-later")
        try:
            later.sync({"rg": Feed("gemma", spec.kv_events)})
            await eventually(
                lambda: later.readers["rg"].blocks.keys == held(), timeout=30, what="the replayed blocks"
            )
            assert later.counters.replayed >= 1 and later.counters.clears == 0
        finally:
            await later.stop()

        store = await ensure_object_store(nc.jetstream(), subjects.bucket_tokenizers)

        async def tokenizer() -> dict[str, bytes] | None:
            try:
                data = (await store.get("gemma")).data
            except ObjectNotFoundError:
                return None
            assert data is not None
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                return {n: z.read(n) for n in z.namelist()}

        files = await eventually(tokenizer, timeout=30, what="gemma's tokenizer put")
        info = decode(files[INFO_ENTRY], TokenizerInfo)
        assert info.kind is TokenizerKind.HF
        tokenizer_json = (install.gemma / "tokenizer.json").read_bytes()
        assert files["tokenizer.json"] == tokenizer_json
        assert info.files["tokenizer.json"] == hashlib.sha256(tokenizer_json).hexdigest()
    finally:
        stop.set()
        await asyncio.wait_for(agent, 120)
    assert any(r.gone for m in tap.deltas for r in m.replicas if r.replica == "rg")
