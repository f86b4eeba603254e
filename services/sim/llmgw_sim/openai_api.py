"""OpenAI wire shapes for the simulated engine: request reading, deterministic text, response bodies.

Everything here is pure and cheap: the simulator must never be the bottleneck of a router benchmark,
so streaming chunks are rendered from a pre-built prefix with one ``json.dumps`` per token.
A token is a whitespace-separated word; the completion continues the prompt's words (its last
``MAX_SOURCE_WORDS``, cycled by their shortest repeating pattern). The answer is a function of the text
so far, so an answer continued from any point (a final assistant message with vLLM's
``continue_final_message``, or a completion's prompt plus the text already generated) is exactly the
rest of the uninterrupted answer: what a router's mid-stream failover is checked against.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

from llmgw_common.errors import InvalidInput

FILLER = ("lorem", "ipsum", "dolor", "sit", "amet")
# Words of the prompt that the completion cycles through: enough for variety, bounded for cost.
MAX_SOURCE_WORDS = 64


class BadRequest(InvalidInput):
    """The request body is not something this endpoint accepts; the message names what was wrong."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, type_: str, code: str | int | None = None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


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


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", "model")
    return model


def _max_tokens(body: dict[str, Any], default: int) -> tuple[int, bool]:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"'{key}' must be a positive integer, got {value!r}", key)
        return value, True
    return default, False


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(body.get("stream") or False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    include_usage = bool(stream and opts and opts.get("include_usage"))
    return stream, include_usage


def _content_words(content: Any, where: str) -> list[str]:
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
    raise BadRequest(f"{where} must be a string or a list of content parts", "messages")


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


def read_chat(body: dict[str, Any], default_max_tokens: int) -> GenRequest:
    model = _model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list", "messages")
    words: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", "messages")
        words += _content_words(m.get("content"), f"messages[{i}].content")
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


def read_completion(body: dict[str, Any], default_max_tokens: int) -> GenRequest:
    model = _model(body)
    prompt = body.get("prompt")
    words: list[str]
    if isinstance(prompt, str):
        words = prompt.split()
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        words = [w for p in prompt for w in p.split()]
    elif isinstance(prompt, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        # Token ids: count them, and speak in filler words.
        words = [FILLER[t % len(FILLER)] for t in prompt]
    else:
        raise BadRequest("'prompt' is required: a string, a list of strings or a list of token ids", "prompt")
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


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(rid: str, created: int, req: GenRequest, tokens: list[str]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(tokens)},
                "logprobs": None,
                "finish_reason": finish_reason(req),
            }
        ],
        "usage": usage(req.prompt_tokens, len(tokens)),
    }


def completion_response(rid: str, created: int, req: GenRequest, tokens: list[str]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": [
            {"index": 0, "text": "".join(tokens), "logprobs": None, "finish_reason": finish_reason(req)}
        ],
        "usage": usage(req.prompt_tokens, len(tokens)),
    }


class ChunkWriter:
    """Renders the SSE events of one streamed answer, chat or text completion.

    Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]``. With
    ``include_usage`` every chunk carries ``"usage": null`` and a last chunk with empty choices
    carries the usage, as OpenAI does.
    """

    __slots__ = ("_cache", "_chat", "_head", "_req", "_tail", "_tok_post", "_tok_pre")

    def __init__(self, rid: str, created: int, req: GenRequest, chat: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": req.model}
        # The constant part of every chunk, rendered once: '{"id":...,"model":"m","choices":'.
        self._head = "data: " + json.dumps(head)[:-1] + ', "choices": '
        self._tail = ', "usage": null}\n\n' if req.include_usage else "}\n\n"
        self._req = req
        self._chat = chat
        # A token's event is this prefix, the JSON string of its text, and this suffix; the answer
        # repeats a few words, so each distinct token is rendered once per stream.
        field = '"delta": {"content": ' if chat else '"text": '
        self._tok_pre = self._head + '[{"index": 0, ' + field
        close = "}" if chat else ""
        self._tok_post = close + ', "logprobs": null, "finish_reason": null}]' + self._tail
        self._cache: dict[str, str] = {}

    def _event(self, choice: dict[str, Any]) -> str:
        return self._head + "[" + json.dumps(choice) + "]" + self._tail

    def first(self) -> str:
        """The role announcement a chat stream opens with; nothing for text completions."""
        if not self._chat:
            return ""
        return self._event(
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def token(self, text: str) -> str:
        event = self._cache.get(text)
        if event is None:
            event = self._cache[text] = self._tok_pre + json.dumps(text) + self._tok_post
        return event

    def end(self, completion: int) -> str:
        """The finishing chunk, the usage chunk when asked for, and ``[DONE]``."""
        reason = finish_reason(self._req)
        if self._chat:
            last: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
        else:
            last = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
        out = self._event(last)
        if self._req.include_usage:
            u = json.dumps(usage(self._req.prompt_tokens, completion))
            out += self._head + '[], "usage": ' + u + "}\n\n"
        return out + "data: [DONE]\n\n"


# ---------------------------------------------------------------- embeddings


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    model: str
    inputs: tuple[str, ...]
    dims: int
    base64: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.split()) for s in self.inputs)


def read_embeddings(body: dict[str, Any], default_dims: int) -> EmbedRequest:
    model = _model(body)
    raw = body.get("input")
    inputs: list[str]
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(s, str) for s in raw):
        inputs = list(raw)
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        inputs = [" ".join(str(t) for t in raw)]
    elif (
        isinstance(raw, list)
        and raw
        and all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in raw)
    ):
        inputs = [" ".join(str(t) for t in x) for x in raw]
    else:
        raise BadRequest("'input' is required: a string, a list of strings or token ids", "input")
    dims = body.get("dimensions", default_dims)
    if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= 65536:
        raise BadRequest(f"'dimensions' must be an integer in 1..65536, got {dims!r}", "dimensions")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise BadRequest(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    return EmbedRequest(model, tuple(inputs), dims, fmt == "base64")


def embedding_vector(text: str, dims: int) -> list[float]:
    """A unit vector that depends only on ``text`` and ``dims``."""
    raw = hashlib.shake_256(text.encode()).digest(2 * dims)
    vec = [(v - 32767.5) / 32767.5 for v in struct.unpack(f"<{dims}H", raw)]
    norm = sum(x * x for x in vec) ** 0.5 or 1.0
    return [x / norm for x in vec]


def embeddings_response(req: EmbedRequest) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for i, text in enumerate(req.inputs):
        vec = embedding_vector(text, req.dims)
        emb: list[float] | str = (
            base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() if req.base64 else vec
        )
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens},
    }
