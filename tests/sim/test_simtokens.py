"""The simulator's tokenizer, shared with the router: stable ids, chat and completion bodies, None for
what the engine refuses, and the simulator's usage counts (words) kept."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from llmgw_common import simtokens
from llmgw_common.simtokens import prompt_token_ids, role_id, word_id
from llmgw_sim import openai_api as oai


def test_word_id_is_stable_across_processes_and_31_bits() -> None:
    # Python's own str hash is salted per process: a second interpreter must agree with this one.
    code = "from llmgw_common.simtokens import word_id; print(word_id('hello'), word_id('wörld'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(word_id("hello")), str(word_id("wörld"))]
    assert word_id("hello") != word_id("hellO")
    ids = {word_id(f"w{i}") for i in range(10_000)}
    assert max(ids) < 1 << 31 and min(ids) >= 0
    assert len(ids) > 9_990  # collisions are rare at 31 bits


def test_a_lone_surrogate_from_json_has_an_id() -> None:
    assert 0 <= word_id("\ud800") < 1 << 31


def test_chat_marks_roles_and_ends_with_the_generation_prompt() -> None:
    user = prompt_token_ids({"messages": [{"role": "user", "content": "hi there"}]})
    assistant = prompt_token_ids({"messages": [{"role": "assistant", "content": "hi there"}]})
    assert user == [role_id("user"), word_id("hi"), word_id("there"), role_id("assistant")]
    assert assistant is not None and user != assistant
    # A role marker is never a word's id: its text holds whitespace, which no word does.
    assert role_id("user") != word_id("user")


def test_the_next_turn_extends_the_prompt_and_its_answer() -> None:
    turn1 = prompt_token_ids({"messages": [{"role": "user", "content": "a b c"}]})
    answer = ["x", "y"]
    turn2 = prompt_token_ids(
        {
            "messages": [
                {"role": "user", "content": "a b c"},
                {"role": "assistant", "content": " ".join(answer)},
                {"role": "user", "content": "d"},
            ]
        }
    )
    assert turn1 is not None and turn2 is not None
    assert turn2[: len(turn1) + 2] == turn1 + [word_id(w) for w in answer]


def test_generation_prompt_follows_vllm_flags() -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "part"}]
    continued = prompt_token_ids(
        {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    )
    assert continued == [role_id("user"), word_id("q"), role_id("assistant"), word_id("part")]
    off = prompt_token_ids({"messages": msgs[:1], "add_generation_prompt": False})
    assert off == [role_id("user"), word_id("q")]


def test_content_parts_count_their_text_only() -> None:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "one two"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                ],
            }
        ]
    }
    assert prompt_token_ids(body) == [role_id("user"), word_id("one"), word_id("two"), role_id("assistant")]


def test_completion_prompts() -> None:
    assert prompt_token_ids({"prompt": "a  b\nc"}) == [word_id("a"), word_id("b"), word_id("c")]
    assert prompt_token_ids({"prompt": ["a b", "c"]}) == [word_id("a"), word_id("b"), word_id("c")]
    assert prompt_token_ids({"prompt": [5, 7, 2**32 - 1]}) == [5, 7, 2**32 - 1]
    # An empty prompt is no tokens, not malformed: the simulator serves it with 0 prompt tokens.
    assert prompt_token_ids({"prompt": ""}) == [] == prompt_token_ids({"prompt": []})


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": None},
        {"prompt": 3},
        {"prompt": [1, "a"]},
        {"prompt": [True]},
        {"prompt": [-1]},
        {"prompt": [2**32]},
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"content": "no role"}]},
        {"messages": ["not a dict"]},
        {"messages": [{"role": "user", "content": 5}]},
    ],
)
def test_nothing_to_tokenize_is_none(body: dict[str, Any]) -> None:
    assert prompt_token_ids(body) is None


def test_the_simulator_counts_the_same_words() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is  it"}]},
    ]
    chat = oai.read_chat({"messages": messages}, 16)
    ids = prompt_token_ids({"messages": messages})
    assert ids is not None
    # Usage counts words only: the ids add one marker per message and the generation prompt.
    assert chat.prompt_tokens == 5 == len(ids) - 3
    assert chat.prompt_words == ("be", "brief", "what", "is", "it")
    comp = oai.read_completion({"prompt": ["a b", "c"]}, 16)
    assert comp.prompt_tokens == 3
    assert simtokens.text_prompt_words(["a b", "c"]) == list(comp.prompt_words)
