"""OpenAI wire shapes for the simulated engine, the request side: request reading and the deterministic
text it gets (the bodies the text is sent in: :mod:`llmgw_sim.openai_bodies`).

Everything here is pure and cheap: the simulator must never be the bottleneck of a router benchmark.
A token is a whitespace-separated word (:mod:`llmgw_common.simtokens`, which a router shares); the
completion continues the prompt's words (its last ``MAX_SOURCE_WORDS``, cycled by their shortest
repeating pattern). The answer is a function of the text so far, so an answer continued from any
point (a final assistant message with vLLM's ``continue_final_message``, or a completion's prompt plus
the text already generated) is exactly the rest of the uninterrupted answer: what a router's
mid-stream failover is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmgw_common import simtokens
from llmgw_sim.errors import BadRequest, invalid, missing

FILLER = ("lorem", "ipsum", "dolor", "sit", "amet")
# Words of the prompt that the completion cycles through: enough for variety, bounded for cost.
MAX_SOURCE_WORDS = 64


__all__ = ["BadRequest", "GenRequest", "read_chat", "read_completion"]


@dataclass(frozen=True, slots=True)
class GenRequest:
    """What a chat or completion request asks of the generator, read from its JSON body."""

    model: str
    prompt_words: tuple[str, ...]
    max_tokens: int
    # True when the client capped the length: the answer ends with finish_reason "length".
    capped: bool
    stream: bool
    include_usage: bool
    # Words of the answer already given (a final assistant message being continued): an uncapped
    # answer ends where the uninterrupted one would.
    answered: int = 0
    # The first token needs a space: the text it continues ends in a word.
    space_first: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_words)


def model_of(body: dict[str, Any]) -> str:
    """The body's model, "" when absent: vLLM then serves its own model, as the engine does."""
    model = body.get("model")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise invalid("model", "string_type", "Input should be a valid string", model)
    return model


def _max_tokens(body: dict[str, Any], default: int) -> tuple[int, bool]:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(key, "int_type", "Input should be a valid integer", value)
        if value < 1:
            # vLLM's sampling parameters refuse it, after validation.
            raise BadRequest(f"max_tokens must be at least 1, got {value}.", key)
        return value, True
    return default, False


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(body.get("stream") or False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("stream_options", "model_type", "Input should be a valid dictionary", opts)
    include_usage = bool(stream and opts and opts.get("include_usage"))
    return stream, include_usage


# vLLM's limits on a cache_salt (``validate_cache_salt``): it becomes part of a block hash and of
# external cache keys.
_MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(body: dict[str, Any]) -> None:
    """Refuse a ``cache_salt`` vLLM refuses: not a non-empty string, longer than 128 characters, or
    holding '@', '/', '\\' or NUL."""
    salt = body.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        msg = "Parameter 'cache_salt' must be a non-empty string if provided."
    elif len(salt) > _MAX_CACHE_SALT or not _SALT_FORBIDDEN.isdisjoint(salt):
        msg = "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
    else:
        return
    raise invalid("cache_salt", "value_error", "Value error, " + msg, salt)


def _content_words(content: Any, where: str) -> list[str]:
    words = simtokens.content_words(content)
    if words is None:
        raise invalid(where, "string_type", "Input should be a valid string", content)
    return words


def _continued_text(body: dict[str, Any], messages: list[Any]) -> str | None:
    """The final assistant message's text when the request asks to continue it (vLLM's rules), else None."""
    if body.get("continue_final_message") is not True:
        return None
    # vLLM's default add_generation_prompt is true, and it refuses the two together.
    if body.get("add_generation_prompt", True) is not False:
        raise BadRequest(
            "'continue_final_message' cannot be used with 'add_generation_prompt' true (its default)",
            "add_generation_prompt",
        )
    last = messages[-1]
    if last.get("role") != "assistant":
        raise BadRequest("'continue_final_message' needs the last message to be the assistant's", "messages")
    content = last.get("content")
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def message_words(messages: Any, field: str = "messages") -> list[str]:
    """The words of a chat's messages (OpenAI's shape, which Anthropic's content blocks share)."""
    if not isinstance(messages, list):
        raise invalid(field, "list_type", "Input should be a valid list", messages)
    if not messages:
        # vLLM's chat template has nothing to render.
        raise BadRequest("messages must not be empty", field)
    words: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"{field}.{i}.role", "missing", "Field required", m)
        words += _content_words(m.get("content"), f"{field}.{i}.content")
    return words


def read_chat(body: dict[str, Any], default_max_tokens: int) -> GenRequest:
    model = model_of(body)
    messages = body.get("messages")
    if messages is None:
        raise missing("messages", body)
    words = message_words(messages)
    check_cache_salt(body)
    continued = _continued_text(body, messages)
    max_tokens, capped = _max_tokens(body, default_max_tokens)
    stream, include_usage = _stream(body)
    if continued is None:
        return GenRequest(model, tuple(words), max_tokens, capped, stream, include_usage)
    return GenRequest(
        model,
        tuple(words),
        max_tokens,
        capped,
        stream,
        include_usage,
        answered=len(continued.split()),
        space_first=bool(continued) and not continued[-1].isspace(),
    )


def _token_id_words(prompt: Any) -> list[str]:
    if isinstance(prompt, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        # Token ids: count them, and speak in filler words.
        return [FILLER[t % len(FILLER)] for t in prompt]
    if prompt is None:
        raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    raise invalid("prompt", "string_type", "Input should be a valid string", prompt)


def read_completion(body: dict[str, Any], default_max_tokens: int) -> GenRequest:
    model = model_of(body)
    prompt = body.get("prompt")
    words = simtokens.text_prompt_words(prompt)
    if words is None:
        words = _token_id_words(prompt)
    check_cache_salt(body)
    max_tokens, capped = _max_tokens(body, default_max_tokens)
    stream, include_usage = _stream(body)
    # A text prompt that ends in a word is continued after a space, as a real model's next token is.
    space_first = isinstance(prompt, str) and bool(prompt) and not prompt[-1].isspace()
    return GenRequest(model, tuple(words), max_tokens, capped, stream, include_usage, space_first=space_first)


def shortest_period(words: tuple[str, ...]) -> int:
    """The smallest p such that ``words[i] == words[i + p]`` throughout (``len(words)`` if none shorter)."""
    n = len(words)
    if len(set(words)) == n:  # the common case, at C speed
        return n
    # Knuth-Morris-Pratt's prefix function: the period is n minus the longest proper border.
    border = [0] * n
    k = 0
    for i in range(1, n):
        while k and words[i] != words[k]:
            k = border[k - 1]
        if words[i] == words[k]:
            k += 1
        border[i] = k
    return n - border[-1]


def completion_tokens(req: GenRequest) -> list[str]:
    """The answer's tokens, each after a space but the first of a new message.

    The text's last ``MAX_SOURCE_WORDS`` words are continued by their shortest repeating pattern (for
    distinct words: the words cycled). Appending the answer keeps that pattern, so a request for the
    text so far plus part of the answer gets the rest of the answer.
    """
    source = req.prompt_words[-MAX_SOURCE_WORDS:] or FILLER
    p = shortest_period(source)
    cycle = source[len(source) - p :]
    count = req.max_tokens if req.capped else max(req.max_tokens - req.answered, 0)
    first = " " if req.space_first else ""
    return [(first if i == 0 else " ") + cycle[i % p] for i in range(count)]


def finish_reason(req: GenRequest) -> str:
    return "length" if req.capped else "stop"
