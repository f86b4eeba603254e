"""The simulator's answers (:mod:`llmgw_sim.answers`): readable, deterministic, salted, continuable."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_sim import answers

TEXT_WORDS = answers.TEXT.split()


def test_an_answer_is_sentences_of_the_text_from_a_sentence_start() -> None:
    got = answers.answer_words(["Say", "hi"], "", 0, 40)
    at = next(i for i in range(len(TEXT_WORDS)) if TEXT_WORDS[i : i + 40] == got)
    assert at == 0 or TEXT_WORDS[at - 1][-1] in ".!?"
    assert got[0][0].isupper()


def test_same_prompt_same_answer_and_prompts_spread_over_the_sentences() -> None:
    prompts = [[f"question{i}", "please"] for i in range(300)]
    firsts = {tuple(answers.answer_words(p, "", 0, 3)) for p in prompts}
    assert answers.answer_words(["a", "b"], "", 0, 9) == answers.answer_words(["a", "b"], "", 0, 9)
    starts = sum(1 for i, w in enumerate(TEXT_WORDS) if i == 0 or TEXT_WORDS[i - 1][-1] in ".!?")
    assert len(firsts) >= starts * 3 // 4, (len(firsts), starts)


def test_a_salt_picks_another_answer_to_the_same_prompt() -> None:
    prompt = ["Say", "hi"]
    assert answers.answer_words(prompt) == answers.answer_words(prompt, "")
    salted = {tuple(answers.answer_words(prompt, f"adapter-{i}", 0, 4)) for i in range(20)}
    assert len(salted) >= 8


def test_a_position_is_a_word_of_the_whole_answer_and_a_long_one_wraps() -> None:
    n = 3 * len(TEXT_WORDS)
    whole = answers.answer_words(["x"], "s", 0, n)
    assert answers.answer_words(["x"], "s", 500, 40) == whole[500:540]
    assert whole[len(TEXT_WORDS) :] == whole[: n - len(TEXT_WORDS)]


def test_answered_is_zero_for_text_that_is_not_an_answer() -> None:
    assert answers.answered([]) == 0
    assert answers.answered(["tell", "me", "more"]) == 0
    # The text's words, but not from the sentence this prompt's answer starts at.
    prompt = ["tell", "me", "more"]
    other = answers.answer_words(prompt, "another-salt", 0, 30)
    assert other != answers.answer_words(prompt, "", 0, 30)
    assert answers.answered(prompt + other, "") < 30


def test_answered_finds_a_long_answer_past_a_wrap_of_the_text() -> None:
    prompt = ["write", "a", "long", "one"]
    n = 2 * len(TEXT_WORDS) + 17
    assert answers.answered(prompt + answers.answer_words(prompt, "lora-a", 0, n), "lora-a") == n


# Words of the text itself among the prompt's, so that a prompt's tail often reads as an answer's start.
prompt_words = st.lists(
    st.sampled_from(["a", "b", "The", "the", "Hello!", "This", "answer", "model.", "A", "note", "on"]),
    max_size=60,
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(prompt=prompt_words, salt=st.sampled_from(["", "lora-a", "é"]), n=st.integers(1, 500), data=st.data())
def test_a_text_plus_k_words_of_its_answer_is_cut_k_further(
    prompt: list[str], salt: str, n: int, data: st.DataObject
) -> None:
    """What makes a completion continued from any point the rest of its answer."""
    done = answers.answered(prompt, salt)
    answer = answers.answer_words(prompt[: len(prompt) - done], salt, done, n)
    k = data.draw(st.integers(0, n), label="k")
    text = prompt + answer[:k]
    assert answers.answered(text, salt) == done + k
    assert answers.answer_words(text[: len(text) - done - k], salt, done + k, n - k) == answer[k:]
