"""The simulated engine's tokenizer: a token is a whitespace-separated word, its id a hash of the word.

It lives here, not in the simulator, so that a router predicts exactly the token ids the simulator's
prefix cache computes (``TokenizerKind.SIM``), and the simulator reads its own prompts with the same
code (its usage counts are the number of words, :func:`content_words` / :func:`text_prompt_words`).

A chat is tokenized as its messages in order, each a role marker then its content's words, so
"user: hi" and "assistant: hi" differ; the generation prompt (vLLM's ``add_generation_prompt``, on by
default, off when the final assistant message is continued) is one more assistant marker, as a chat
template ends with the assistant's header. So an answer's words extend its prompt exactly as the next
turn re-sends them, and a conversation's next turn hits the blocks of the answer before it.
A completion's prompt is its words, or its token ids used as they are.

Pure and cheap: a word's id is cached (bounded), and nothing here is called when no cache is on.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = [
    "TOKEN_ID_LIMIT",
    "chat_token_ids",
    "content_words",
    "prompt_token_ids",
    "role_id",
    "text_prompt_words",
    "word_id",
]

# A word's id is 31 bits; token ids given by a client are used as they are but must fit 32 bits
# (llmgw's block keys hash ids as unsigned 32-bit integers, as vLLM's vocabularies always fit).
TOKEN_ID_LIMIT = 1 << 32
_WORD_MASK = (1 << 31) - 1
_PERSON = b"llmgw-simtok"
# Words whose ids are remembered; past this many the memory starts over (a bound, not an LRU: a
# workload's vocabulary is far smaller).
_REMEMBERED = 1 << 17


def _hash_word(word: str) -> int:
    # surrogatepass: JSON may carry a lone surrogate, which plain UTF-8 refuses.
    d = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=4, person=_PERSON).digest()
    return int.from_bytes(d, "little") & _WORD_MASK


class _Ids(dict[str, int]):
    """Word -> id, computed on a miss: a hit is one C-level dict lookup (half an lru_cache's cost), which
    is most of tokenizing a long prompt on a router's hot path."""

    def __missing__(self, word: str) -> int:
        if len(self) >= _REMEMBERED:
            self.clear()
        tid = self[word] = _hash_word(word)
        return tid


_IDS = _Ids()
_id_of = _IDS.__getitem__


def word_id(word: str) -> int:
    """A word's token id: 31 bits of BLAKE2b over its UTF-8, the same in every process (never Python's
    salted ``hash``)."""
    return _id_of(word)


def role_id(role: str) -> int:
    """The marker token of a message's role. Its text starts with a newline, which no word holds (a
    word never contains whitespace), so a marker is never a word's id by construction of its text."""
    return word_id("\n" + role)


def content_words(content: Any) -> list[str] | None:
    """The words of a chat message's content: a string, or parts of which the text parts count (the
    OpenAI shape); no content is no words. None when the content is neither (the engine's 400)."""
    if content is None:
        return []
    if isinstance(content, str):
        return content.split()
    if isinstance(content, list):
        words: list[str] = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                words += part["text"].split()
        return words
    return None


def text_prompt_words(prompt: Any) -> list[str] | None:
    """The words of a completion's text prompt: a string, or strings read as one text. None for any
    other prompt (token ids are read by :func:`prompt_token_ids`; anything else is the engine's 400)."""
    if isinstance(prompt, str):
        return prompt.split()
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return [w for p in prompt for w in p.split()]
    return None


def _token_ids(prompt: Any) -> list[int] | None:
    if not isinstance(prompt, list) or not prompt:
        return None
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < TOKEN_ID_LIMIT:
            return None
    return list(prompt)


def chat_token_ids(messages: Any, generation_prompt: bool = True) -> list[int] | None:
    """A chat's token ids: per message its role marker then its words; then, with
    ``generation_prompt``, the assistant's marker. None when the messages are malformed."""
    if not isinstance(messages, list) or not messages:
        return None
    ids: list[int] = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        role = m.get("role")
        words = content_words(m.get("content"))
        if not isinstance(role, str) or words is None:
            return None
        ids.append(role_id(role))
        ids += map(_id_of, words)
    if generation_prompt:
        ids.append(role_id("assistant"))
    return ids


def prompt_token_ids(body: dict[str, Any]) -> list[int] | None:
    """The token ids of a chat (``messages``) or completion (``prompt``) request body, as the
    simulator's prefix cache computes them; None when the body has nothing this can tokenize."""
    if "messages" in body:
        # vLLM's chat template appends the assistant's header unless told not to, or unless the final
        # (assistant) message is being continued.
        continued = body.get("continue_final_message") is True
        generation_prompt = not continued and body.get("add_generation_prompt", True) is not False
        return chat_token_ids(body["messages"], generation_prompt)
    prompt = body.get("prompt")
    words = text_prompt_words(prompt)
    if words is not None:
        return list(map(_id_of, words))
    return _token_ids(prompt)
