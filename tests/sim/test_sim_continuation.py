"""Continuing a final assistant message (vLLM's ``continue_final_message``) and a completion's prompt.

The simulator's answer is a function of the text so far: continuing from any point yields exactly the
rest of the uninterrupted answer, which is what makes a router's mid-stream failover checkable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam

from llmgw_sim import answers
from llmgw_sim import openai_api as oai
from llmgw_sim.serving import Listening

MODEL = "sim-test"
USER = [{"role": "user", "content": "alpha beta gamma delta"}]


def _chat(messages: list[dict[str, Any]], **extra: Any) -> oai.GenRequest:
    return oai.read_chat({"model": MODEL, "messages": messages, **extra}, 16)


def _text(req: oai.GenRequest) -> str:
    return "".join(oai.completion_tokens(req))


def test_the_answer_reads_as_text_and_does_not_repeat_the_prompt() -> None:
    # Pinned: the hash that picks the sentence is the same in every process and every version.
    text = _text(_chat([{"role": "user", "content": "Say hi"}], max_tokens=12))
    assert text == "Logs of every service are in the data directory, one file each."
    for prompt in ("alpha beta gamma delta", "x y", "x", "a b a"):
        words = _text(_chat([{"role": "user", "content": prompt}], max_tokens=6)).split()
        assert words == answers.answer_words(prompt.split(), "", 0, 6)
        # A sentence's start, not the prompt again.
        assert words[0][0].isupper() and not " ".join(words).startswith(prompt)


@pytest.mark.parametrize("k", [0, 1, 3, 5], ids=lambda k: f"after-{k}")
def test_chat_continuation_is_the_rest_of_the_answer(k: int) -> None:
    full = oai.completion_tokens(_chat(USER, max_tokens=6))
    cont = _chat(
        [*USER, {"role": "assistant", "content": "".join(full[:k])}],
        max_tokens=6 - k,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert oai.completion_tokens(cont) == full[k:]
    # The partial answer is part of the prompt, as an engine counts it.
    assert cont.prompt_tokens == 4 + k


def test_uncapped_continuation_stops_where_the_answer_would() -> None:
    full = oai.completion_tokens(_chat(USER))
    assert len(full) == 16
    cont = _chat(
        [*USER, {"role": "assistant", "content": "".join(full[:10])}],
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert oai.completion_tokens(cont) == full[10:]
    assert oai.finish_reason(cont) == "stop"


def test_final_assistant_message_without_the_flag_is_a_new_turn() -> None:
    first = _text(_chat(USER, max_tokens=2))
    req = _chat([*USER, {"role": "assistant", "content": first}], max_tokens=2)
    # The answer to the whole conversation, from its start: no leading space, a new message starts.
    want = answers.answer_words(["alpha", "beta", "gamma", "delta", *first.split()], "", 0, 2)
    assert _text(req) == " ".join(want)


@pytest.mark.parametrize(
    ("messages", "extra", "words"),
    [
        (USER, {"continue_final_message": True, "add_generation_prompt": False}, "last message"),
        (
            [*USER, {"role": "assistant", "content": "alpha"}],
            {"continue_final_message": True},
            "add_generation_prompt",
        ),
        (
            [*USER, {"role": "assistant", "content": "alpha"}],
            {"continue_final_message": True, "add_generation_prompt": True},
            "add_generation_prompt",
        ),
    ],
    ids=["last-is-user", "generation-prompt-default", "generation-prompt-true"],
)
def test_continue_final_message_refusals(
    messages: list[dict[str, Any]], extra: dict[str, Any], words: str
) -> None:
    with pytest.raises(oai.BadRequest, match=words):
        _chat(messages, **extra)


@pytest.mark.parametrize("k", [1, 2, 4], ids=lambda k: f"after-{k}")
def test_completion_continuation_from_prompt_plus_text(k: int) -> None:
    full = oai.completion_tokens(
        oai.read_completion({"model": MODEL, "prompt": "once upon a", "max_tokens": 6}, 16)
    )
    # A completion continues the prompt's text: its first word comes after a space.
    assert full == [" " + w for w in answers.answer_words(["once", "upon", "a"], "", 0, 6)]
    prompt = "once upon a" + "".join(full[:k])
    cont = oai.read_completion({"model": MODEL, "prompt": prompt, "max_tokens": 6 - k}, 16)
    assert oai.completion_tokens(cont) == full[k:]


# With words of the answers' own text, so that a prompt's tail often reads as the start of an answer.
words = st.lists(
    st.sampled_from(["a", "b", "c", "dd", "é", '"q"', "The", "the", "Hello!", "This", "answer", "model."]),
    min_size=1,
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(prompt=words, n=st.integers(1, 120), data=st.data())
def test_any_continuation_point_gives_the_rest(prompt: list[str], n: int, data: st.DataObject) -> None:
    msgs = [{"role": "user", "content": " ".join(prompt)}]
    full = oai.completion_tokens(_chat(msgs, max_tokens=n))
    k = data.draw(st.integers(0, n - 1), label="k")
    cont = _chat(
        [*msgs, {"role": "assistant", "content": "".join(full[:k])}],
        max_tokens=n - k,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert oai.completion_tokens(cont) == full[k:]
    comp = oai.completion_tokens(
        oai.read_completion({"model": MODEL, "prompt": " ".join(prompt), "max_tokens": n}, 16)
    )
    cont_c = oai.read_completion(
        {"model": MODEL, "prompt": " ".join(prompt) + "".join(comp[:k]), "max_tokens": n - k}, 16
    )
    assert oai.completion_tokens(cont_c) == comp[k:]


async def test_continue_final_message_over_http(engine: Callable[..., Awaitable[Listening]]) -> None:
    srv = await engine(model=MODEL, zero=True)
    user: list[ChatCompletionMessageParam] = [{"role": "user", "content": "alpha beta gamma delta"}]
    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as client:
        full = await client.chat.completions.create(model=MODEL, messages=user, max_tokens=6)
        text = full.choices[0].message.content
        assert text == " ".join(answers.answer_words(["alpha", "beta", "gamma", "delta"], "", 0, 6))
        partial = " ".join(text.split()[:2])
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[*user, {"role": "assistant", "content": partial}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
        chunks = [c async for c in stream]
        assert partial + "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        usage = chunks[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (6, 4)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model=MODEL,
                messages=user,
                extra_body={"continue_final_message": True},
            )
