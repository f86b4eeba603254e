"""OpenAI wire shapes for the simulated engine, the request side: request reading and the deterministic
text it gets (the bodies the text is sent in: :mod:`llmgw_sim.openai_bodies`).

Everything here is pure and cheap: the simulator must never be the bottleneck of a router benchmark.
A token is a whitespace-separated word (:mod:`llmgw_common.simtokens`, which a router shares); the
answer is readable text, a function of the prompt and a salt (:mod:`llmgw_sim.answers`), so an answer
continued from any point (a final assistant message with vLLM's ``continue_final_message``, or a
completion's prompt plus the text already generated) is exactly the rest of the uninterrupted answer:
what a router's mid-stream failover is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmgw_common import simtokens
from llmgw_sim import answers
from llmgw_sim.errors import BadRequest, invalid, missing

# The words a prompt of token ids reads as (and /detokenize's words for unknown ids).
FILLER = ("lorem", "ipsum", "dolor", "sit", "amet")


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
    # answer ends where the uninterrupted one would. None: read from the text (a completion's prompt
    # may be an earlier prompt plus the text of its answer, :func:`llmgw_sim.answers.answered`).
    answered: int | None = 0
    # The first token needs a space: the text it continues ends in a word.
    space_first: bool = False
    # Enters the choice of the answer: another salt, another answer to the same prompt.
    salt: str = ""

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
    # The prompt may be an earlier one plus text of its answer (a router continuing a stream).
    return GenRequest(
        model, tuple(words), max_tokens, capped, stream, include_usage, answered=None, space_first=space_first
    )


def completion_tokens(req: GenRequest) -> list[str]:
    """The answer's tokens, each after a space but the first of a new message.

    The words the text already holds of the answer (``answered``) are skipped: a request for the text
    so far plus part of the answer gets the rest of the answer.
    """
    words = req.prompt_words
    done = answers.answered(words, req.salt) if req.answered is None else min(req.answered, len(words))
    count = req.max_tokens if req.capped else max(req.max_tokens - done, 0)
    first = " " if req.space_first else ""
    new = answers.answer_words(words[: len(words) - done], req.salt, done, count)
    return [(first if i == 0 else " ") + w for i, w in enumerate(new)]


def finish_reason(req: GenRequest) -> str:
    return "length" if req.capped else "stop"
