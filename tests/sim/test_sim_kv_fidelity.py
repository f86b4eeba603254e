"""The simulator's KV events held to real vLLM's: the requests of the recorded vLLM 0.32 run
(``tests/fixtures/vllm_kv``: gemma-3-270m on CPU, block size 128) replayed on the simulator give
messages of the same framing, batches at the same steps, and events whose maps have vLLM's keys in
vLLM's order, with the full-attention group's tags and the salt where vLLM puts it."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from llmgw_sim.options import SimOptions
from llmgw_sim.serving import start

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/vllm_kv/gemma-3-270m-cpu.msgpack"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kv", dir="/tmp") as d:
        yield Path(d)


def recorded() -> dict[str, Any]:
    data: dict[str, Any] = msgpack.unpackb(FIXTURE.read_bytes(), raw=False, strict_map_key=False)
    return data


def full_attention(payload: bytes) -> list[dict[str, Any]]:
    """The raw event maps of a batch that a full-attention model's one group would carry."""
    _, events, _ = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return [e for e in events if e.get("kv_cache_spec_kind", "full_attention") == "full_attention"]


@pytest.mark.slow
async def test_replaying_vllms_requests_gives_vllms_messages(sock_dir: Path) -> None:
    rec = recorded()
    vllm_frames = rec["frames"]
    endpoint = f"ipc://{sock_dir}/kv.sock"
    srv = await start(
        SimOptions(port=0, zero=True, block_size=128, kv_events_endpoint=endpoint, kv_events_topic="kv")
    )
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        await asyncio.sleep(0.3)  # ZMQ's slow joiner
        async with aiohttp.ClientSession() as http:
            for p in rec["prompts"]:
                body = {**p["body"], "model": "sim-model", "max_tokens": p["usage"]["completion_tokens"]}
                async with http.post(srv.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
        sim_frames: list[list[bytes]] = []
        while len(sim_frames) < len(vllm_frames) + 1:
            try:
                sim_frames.append(await asyncio.wait_for(sub.recv_multipart(), 1.0))
            except TimeoutError:
                break
    finally:
        sub.close(linger=0)
        ctx.term()
        await srv.runner.cleanup()

    # vLLM sent a batch for the first prompt and for the salted one; the second turn's full blocks
    # were all cached, and no answer filled a block: nothing then. The simulator too.
    assert len(sim_frames) == len(vllm_frames) == 2
    for (s_topic, s_seq, s_payload), (v_topic, v_seq, v_payload) in zip(sim_frames, vllm_frames, strict=True):
        assert (s_topic, s_seq) == (v_topic, v_seq)
        s_batch = msgpack.unpackb(s_payload, raw=False)
        v_batch = msgpack.unpackb(v_payload, raw=False)
        assert len(s_batch) == len(v_batch) == 3 and s_batch[2] == v_batch[2] == 0
        assert isinstance(s_batch[0], float)
        (s_event,) = full_attention(s_payload)
        (v_event,) = full_attention(v_payload)
        # Same keys in the same order (the group index differs: gemma's full-attention group is its
        # sixth, after five sliding-window ones; a plain model's only group is 0).
        assert list(s_event) == list(v_event)
        assert s_event["group_idx"] == 0 and v_event["group_idx"] == 5
        same = (
            "type",
            "parent_block_hash",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "kv_cache_spec_kind",
        )
        assert {k: s_event[k] for k in same} == {k: v_event[k] for k in same}
        assert len(s_event["token_ids"]) == 128 * len(s_event["block_hashes"])
        assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in s_event["block_hashes"])
        # The salt in the first block's extra keys only, or none at all: as vLLM.
        assert s_event["extra_keys"][0] == v_event["extra_keys"][0]
        assert all(k is None for k in s_event["extra_keys"][1:])
