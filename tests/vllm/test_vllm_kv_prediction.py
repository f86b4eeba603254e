"""A router's predicted prefix blocks against the blocks a real vLLM 0.32 reports storing (issue 32, 3).

One vLLM (gemma-3-270m on one core, prefix caching, KV events over ZMQ on ``ipc://``,
``PYTHONHASHSEED=0``, requests' own chat templates trusted so that other templates can be checked too)
serves the whole module. For each request the router's :class:`HfPromptTokenizer` predicts the prompt's
token ids from the model directory's files; the engine then publishes ``BlockStored`` events, and the
full-attention group's token ids, followed through ``parent_block_hash`` back to the root, must be the
first ``n * block_size`` predicted ids, so that ``block_keys`` over the prediction are the keys an
agent computes from those events. The engine's own prompt ids (``return_token_ids``) are compared too,
for request options that change the prompt without filling a block.

What the event stream shows (asserted in ``test_the_event_stream_as_vllm_0_32_sends_it_on_cpu`` and
``test_blocks_filled_by_generated_tokens_are_stored_too``): blocks of 128 tokens; one ``BlockStored``
per KV-cache group, Gemma 3's groups 0-4 ``sliding_window`` (window 512) and group 5
``full_attention``, with the same block hashes for the same tokens, the sliding-window groups reporting
a subset (blocks out of their window missing); batch sequence numbers count from 0 by one; ``medium``
is ``"GPU"`` on CPU too; a block that generated tokens fill is stored as well, its token ids the
prompt's tail and the output's head.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import zmq

from llmgw_common.kvcache import block_keys
from llmgw_common.vllm_kv_events import BlockStored, decode_frames
from llmgw_router.cache.hf_files import TOKENIZER_FILES
from llmgw_router.cache.hf_tokenizer import HfPromptTokenizer
from tests.vllm.vllm_kit import VllmInstall, VllmServer, engine_env, require_vllm, start_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1500)]

MODEL = "gemma"
BLOCK = 128
MAX_MODEL_LEN = 2048
FULL = "full_attention"
TIMEOUT = httpx.Timeout(300.0)
WORDS = (
    "river stone lantern harbor orchard meadow copper violet thunder quiet bridge market winter "
    "signal garden mirror canyon ember falcon pillar saddle timber velvet willow anchor beacon"
).split()


@dataclass
class EventLog:
    """Every batch the engine published, read from its ZMQ socket: the full-attention blocks by hash."""

    sock: zmq.Socket[bytes]
    seqs: list[int] = field(default_factory=list)
    stored: list[BlockStored] = field(default_factory=list)
    blocks: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)
    topics: set[str] = field(default_factory=set)

    def drain(self, wait_s: float = 0.3) -> list[BlockStored]:
        """What arrived until ``wait_s`` passed with nothing new; the new full-attention blocks."""
        new: list[BlockStored] = []
        while self.sock.poll(int(wait_s * 1000)):
            topic, seq, batch = decode_frames(self.sock.recv_multipart())
            self.topics.add(topic)
            self.seqs.append(seq)
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    self.stored.append(ev)
                    if ev.kv_cache_spec_kind == FULL:
                        new.append(ev)
                        self._index(ev)
        return new

    def _index(self, ev: BlockStored) -> None:
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            self.blocks[h] = (parent, tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]))
            parent = h

    def chain_tokens(self, leaf: int) -> list[int]:
        """The tokens of the block chain ending at ``leaf``, root first, as the engine reported them."""
        parts: list[tuple[int, ...]] = []
        h: int | None = leaf
        while h is not None:
            assert h in self.blocks, f"block {h} reported as a parent but never stored"
            h, tokens = self.blocks[h]
            parts.append(tokens)
        return [t for p in reversed(parts) for t in p]


@dataclass
class Engine:
    server: VllmServer
    events: EventLog
    http: httpx.Client
    tokenizer: HfPromptTokenizer
    files: dict[str, bytes]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    install: VllmInstall = require_vllm()
    run = tmp_path_factory.mktemp("kv-prediction")
    endpoint = f"ipc://{run}/kv.sock"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    args = [
        "--enable-prefix-caching",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--trust-request-chat-template",
        "--kv-events-config",
        json.dumps(config),
    ]
    files = {n: (install.gemma / n).read_bytes() for n in TOKENIZER_FILES if (install.gemma / n).is_file()}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    # Connected before vLLM binds (ZMQ retries): no batch is published before a subscriber is there.
    sock.connect(endpoint)
    server = start_vllm(
        install, install.gemma, run, name=MODEL, args=args, env=engine_env("0", PYTHONHASHSEED="0")
    )
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            log = EventLog(sock)
            log.drain()
            yield Engine(server, log, http, HfPromptTokenizer(files), files)
    finally:
        sock.close()
        ctx.term()
        server.stop()


def text(tag: str, words: int, seed: int) -> str:
    rng = random.Random(f"{tag}/{seed}")
    return f"[{tag}] " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def post(engine: Engine, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = engine.http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, f"{path} {r.status_code}: {r.text[:400]}\n{engine.server.tail()}"
    out: dict[str, Any] = r.json()
    return out


def stored_for(
    engine: Engine, path: str, body: dict[str, Any], predicted: list[int]
) -> tuple[list[int], dict[str, Any]]:
    """Send ``body``; the tokens of the longest full-attention chain the engine reported storing for it
    (its new blocks, and the cached blocks they hang from), once it covers the prediction's full blocks.
    A late batch of an earlier request may arrive meanwhile: only chains starting with this request's
    first block count (a wrong first block finds none and fails)."""
    engine.events.drain(0.05)
    answer = post(engine, path, {**body, "return_token_ids": True})
    want = len(predicted) // BLOCK * BLOCK
    new: list[BlockStored] = []
    deadline = time.monotonic() + 30
    longest: list[int] = []
    while time.monotonic() < deadline:
        new += engine.events.drain(0.3)
        for ev in new:
            tokens = engine.events.chain_tokens(ev.block_hashes[-1])
            if tokens[:BLOCK] == predicted[:BLOCK] and len(tokens) > len(longest):
                longest = tokens
        if want and len(longest) >= want:
            return longest, answer
    raise AssertionError(
        f"no chain of {want} tokens reported in 30 s ({len(new)} new store events, longest {len(longest)})"
    )


def check_prediction(
    engine: Engine, path: str, body: dict[str, Any], min_blocks: int
) -> tuple[list[int], list[int]]:
    predicted = engine.tokenizer.prompt_ids(body)
    assert predicted is not None
    stored, answer = stored_for(engine, path, body, predicted)
    n = len(predicted) // BLOCK
    assert n >= min_blocks, f"the prompt fills {n} blocks, the test wants {min_blocks}"
    # The engine's own prompt ids are the prediction (chat and completions both return them).
    engine_prompt = answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids")
    assert engine_prompt == predicted
    assert stored[: n * BLOCK] == predicted[: n * BLOCK]
    assert block_keys(predicted, BLOCK) == block_keys(stored, BLOCK)[:n]
    return predicted, stored


def history(tag: str, system: bool, exchanges: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": text(tag, 90, 0)}] if system else []
    for i in range(exchanges):
        msgs += [
            {"role": "user", "content": text(tag, 60, 2 * i + 1)},
            {"role": "assistant", "content": text(tag, 60, 2 * i + 2)},
        ]
    return [*msgs, {"role": "user", "content": text(tag, 25, 99)}]


# ---------------------------------------------------------------- chat


def test_a_multi_turn_chat_with_a_system_prompt(engine: Engine) -> None:
    check_prediction(
        engine, "/v1/chat/completions", {"messages": history("sys", True, 3), "max_tokens": 2}, 3
    )


def test_a_chat_without_a_system_prompt(engine: Engine) -> None:
    check_prediction(
        engine, "/v1/chat/completions", {"messages": history("nosys", False, 3), "max_tokens": 2}, 3
    )


def test_a_chat_with_content_given_as_text_parts(engine: Engine) -> None:
    msgs = history("parts", True, 2)
    for m in msgs:
        words = str(m["content"]).split(" ")
        half = len(words) // 2
        m["content"] = [
            {"type": "text", "text": " ".join(words[:half])},
            {"type": "text", "text": " ".join(words[half:])},
        ]
    check_prediction(engine, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2}, 2)


def test_a_second_turn_extends_the_first_ones_blocks(engine: Engine) -> None:
    first = history("turns", True, 2)
    pred1, _ = check_prediction(engine, "/v1/chat/completions", {"messages": first, "max_tokens": 4}, 2)
    second = [
        *first,
        {"role": "assistant", "content": text("turns", 40, 50)},
        {"role": "user", "content": text("turns", 50, 51)},
    ]
    pred2, stored2 = check_prediction(
        engine, "/v1/chat/completions", {"messages": second, "max_tokens": 2}, 3
    )
    # What the router reuses: the first turn's full blocks are the second's first blocks, by key.
    n1 = len(pred1) // BLOCK
    assert block_keys(pred2, BLOCK)[:n1] == block_keys(pred1, BLOCK)
    assert block_keys(stored2, BLOCK)[:n1] == block_keys(pred1, BLOCK)


# ---------------------------------------------------------------- completions


def test_a_completion_prompt_string_and_the_same_as_token_ids(engine: Engine) -> None:
    prompt = " ".join(text("completion", 70, i) for i in range(4))
    pred, _ = check_prediction(engine, "/v1/completions", {"prompt": prompt, "max_tokens": 2}, 2)
    assert pred[0] == 2  # vLLM's completions add BOS (tokenizer.json's post-processor)
    ids = engine.tokenizer.prompt_ids({"prompt": prompt, "add_special_tokens": False})
    assert ids is not None and ids == pred[1:]
    # The same ids sent as ids, one block shorter: a cached prefix, the new block hangs from it.
    check_prediction(
        engine,
        "/v1/completions",
        {"prompt": pred[: len(pred) - BLOCK + 5] + [9259] * 130, "max_tokens": 1},
        2,
    )


# ---------------------------------------------------------------- generated tokens


def test_blocks_filled_by_generated_tokens_are_stored_too(engine: Engine) -> None:
    # A prompt ending a few tokens short of a block boundary, and more tokens out than that: vLLM
    # caches the block once the generated tokens fill it (its KV computed), so the chain runs past the
    # prompt with the output ids; a router's prediction covers the prompt's full blocks only.
    base = " ".join(text("output", 60, i) for i in range(6))
    ids = engine.tokenizer.prompt_ids({"prompt": base})
    assert ids is not None and len(ids) > 2 * BLOCK
    prompt_ids = ids[: 2 * BLOCK - 3]
    body = {"prompt": prompt_ids, "max_tokens": 12, "ignore_eos": True}
    stored, answer = stored_for(engine, "/v1/completions", body, prompt_ids)
    out = answer["choices"][0]["token_ids"]
    assert len(out) == 12
    deadline = time.monotonic() + 10
    while len(stored) < 2 * BLOCK and time.monotonic() < deadline:
        for ev in engine.events.drain(0.3):
            longer = engine.events.chain_tokens(ev.block_hashes[-1])
            if longer[:BLOCK] == prompt_ids[:BLOCK] and len(longer) > len(stored):
                stored = longer
    assert stored[: 2 * BLOCK] == (prompt_ids + out)[: 2 * BLOCK]


# ---------------------------------------------------------------- the prompt ids, option by option


FIDELITY: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"messages": [{"role": "user", "content": "Hello there"}]}),
    ("system", {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]}),
    (
        "two systems",
        {
            "messages": [
                {"role": "system", "content": "A"},
                {"role": "system", "content": "B"},
                {"role": "user", "content": "Hi"},
            ]
        },
    ),
    (
        "developer",
        {"messages": [{"role": "developer", "content": "Dev rules."}, {"role": "user", "content": "Hi"}]},
    ),
    (
        "parts",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
                }
            ]
        },
    ),
    (
        "extra part field",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
                }
            ]
        },
    ),
    ("empty content", {"messages": [{"role": "user", "content": ""}]}),
    (
        "no generation prompt",
        {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
    ),
    (
        "continue final",
        {
            "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
    ("name", {"messages": [{"role": "user", "content": "Hi", "name": "bob"}]}),
    (
        "kwargs",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "chat_template_kwargs": {"enable_thinking": True, "flavour": 1},
        },
    ),
    ("reasoning effort", {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "low"}),
    (
        "special tokens in text",
        {"messages": [{"role": "user", "content": "a <start_of_turn> b <end_of_turn>\n<bos>"}]},
    ),
    ("unicode and spaces", {"messages": [{"role": "user", "content": "  émoji 🎉 中文\n\n\ttab  "}]}),
    (
        "tool turn",
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
            ]
        },
    ),
    ("add special tokens", {"messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": True}),
]


@pytest.mark.parametrize(("case", "body"), FIDELITY, ids=[c for c, _ in FIDELITY])
def test_prompt_ids_are_the_engines_own(engine: Engine, case: str, body: dict[str, Any]) -> None:
    predicted = engine.tokenizer.prompt_ids(body)
    answer = post(engine, "/v1/chat/completions", {**body, "max_tokens": 1, "return_token_ids": True})
    assert predicted == answer["prompt_token_ids"], case


# Templates of other shapes, sent as the request's own template (the server trusts them here) and
# predicted from the same files with that template in place of gemma's.
OTHER_TEMPLATES = {
    "openai parts": (
        "{{ bos_token }}{% for message in messages %}<{{ message['role'] }}>"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'text' %}[{{ part['text'] }}]{% endif %}{% endfor %}"
        "{% endif %}</{{ message['role'] }}>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    ),
    "kwargs and developer": (
        "{{ bos_token }}{% if enable_thinking %}<think>{% endif %}{% for m in messages %}"
        "{{ m.role }}: {{ m.content | trim }}\n{% endfor %}{# 'developer' is a role here #}"
    ),
}


@pytest.mark.parametrize("name", sorted(OTHER_TEMPLATES))
def test_other_templates_render_as_the_engine_renders_them(engine: Engine, name: str) -> None:
    template = OTHER_TEMPLATES[name]
    tokenizer = HfPromptTokenizer({**engine.files, "chat_template.jinja": template.encode()})
    bodies: list[dict[str, Any]] = [
        {
            "messages": [
                {"role": "developer", "content": "D"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        },
        {"messages": [{"role": "user", "content": "plain"}], "reasoning_effort": "high"},
        {
            "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"enable_thinking": True},
            "add_generation_prompt": False,
        },
    ]
    for body in bodies:
        predicted = tokenizer.prompt_ids(body)
        answer = post(
            engine,
            "/v1/chat/completions",
            {**body, "chat_template": template, "max_tokens": 1, "return_token_ids": True},
        )
        assert predicted == answer["prompt_token_ids"], body


# ---------------------------------------------------------------- the stream itself


def test_the_event_stream_as_vllm_0_32_sends_it_on_cpu(engine: Engine) -> None:
    check_prediction(
        engine, "/v1/chat/completions", {"messages": history("stream", True, 1), "max_tokens": 1}, 1
    )
    log = engine.events
    assert log.topics == {"kv"}
    assert log.seqs == list(range(len(log.seqs))), "sequence numbers count from 0, one per batch"
    kinds = {(ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) for ev in log.stored}
    assert kinds == {(g, "sliding_window", 512) for g in range(5)} | {(5, FULL, None)}, kinds
    assert {ev.block_size for ev in log.stored} == {BLOCK}
    assert {ev.medium for ev in log.stored} == {"GPU"}
    # Each sliding-window group reports a subset of the full-attention group's blocks (7 of 8 in one
    # run of this module: blocks out of the window are not kept), never a block of its own: the
    # full-attention group alone names every block a prompt prefix can reuse.
    groups: dict[int | None, set[int]] = {}
    for ev in log.stored:
        groups.setdefault(ev.group_idx, set()).update(ev.block_hashes)
    assert all(hashes <= groups[5] for hashes in groups.values()), {g: len(h) for g, h in groups.items()}
