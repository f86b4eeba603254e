"""Mid-stream failover, the pure part: what a client has been sent of a stream (:class:`Sent`) and the
request that continues it elsewhere (:func:`plan`). The continuation's events are spliced into the
client's stream by ``relay.py``; the I/O is ``migration.py``.

The continuation is the original request with the text sent so far: for chat, a final assistant
message with ``continue_final_message: true, add_generation_prompt: false`` (vLLM's flags; llama.cpp
continues a final assistant message by default and ignores them); for completions, the prompt plus the
text. ``max_tokens`` (or ``max_completion_tokens``) is reduced by the tokens sent.

Not continued (the stream ends as before, a 502 in the metrics): several choices (``n`` > 1), tool
calls or reasoning text in the answer (they cannot be handed back as a partial message), ``echo``,
and a prompt that is not one string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "text"]
# Text of one answer kept for a continuation; a longer answer is not continued (nor kept: an engine that
# streams without end would otherwise grow the router without bound).
MAX_TEXT_CHARS = 1 << 20
# Tokens of text joined into one string in the record (a fold joins all it read as well).
_JOIN_EVERY = 128
DONE = b"data: [DONE]\n\n"
SEP = b"\n\n"


@dataclass(slots=True)
class Sent:
    """What the client has received of one streamed answer (its choice 0)."""

    id: Any = None
    created: Any = None
    model: Any = None
    object: Any = None
    text: list[str] = field(default_factory=list)
    # Characters of text seen (kept in ``text`` up to MAX_TEXT_CHARS).
    chars: int = 0
    # Events that carried text: one token each, as engines stream them.
    tokens: int = 0
    role: bool = False
    finished: bool = False
    done: bool = False
    # Why this answer cannot be continued elsewhere ("" when it can).
    blocker: str = ""
    usage: tuple[int, int] | None = None
    # Events carry a "usage" key (null until the last): include_usage was asked for.
    usage_key: bool = False

    def add_text(self, text: str) -> None:
        """One token's text; past MAX_TEXT_CHARS the record is dropped and the answer not continued."""
        self.tokens += 1
        self.chars += len(text)
        if self.chars <= MAX_TEXT_CHARS:
            self.text.append(text)
            if len(self.text) % _JOIN_EVERY == 0:
                # One string per _JOIN_EVERY tokens, not one per token (~60 bytes of object each).
                self.text[-_JOIN_EVERY:] = ["".join(self.text[-_JOIN_EVERY:])]
        else:
            self._too_long()

    def add_texts(self, texts: list[str]) -> None:
        """Many tokens' text (a fold), kept as one string."""
        self.tokens += len(texts)
        joined = "".join(texts)
        self.chars += len(joined)
        if self.chars <= MAX_TEXT_CHARS:
            self.text.append(joined)
        else:
            self._too_long()

    def _too_long(self) -> None:
        if self.text:
            self.text = []
            self.blocker = f"an answer longer than {MAX_TEXT_CHARS} characters"

    def observe(self, obj: dict[str, Any]) -> None:
        """Take in one event's JSON."""
        if self.id is None:
            self.id, self.created = obj.get("id"), obj.get("created")
            self.model, self.object = obj.get("model"), obj.get("object")
        if "usage" in obj:
            self.usage_key = True
        u = obj.get("usage")
        if isinstance(u, dict):
            self.usage = (int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0))
        for c in obj.get("choices") or ():
            if not isinstance(c, dict):
                self.blocker = "an event that is not OpenAI's shape"
                continue
            if c.get("index", 0) != 0:
                self.blocker = "several choices (n > 1)"
                continue
            delta = c.get("delta")
            if isinstance(delta, dict):
                if delta.get("tool_calls") or delta.get("function_call"):
                    self.blocker = "tool calls"
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.blocker = "reasoning text"
                if "role" in delta:
                    self.role = True
                text = delta.get("content")
            else:
                text = c.get("text")
            if isinstance(text, str) and text:
                self.add_text(text)
            if c.get("finish_reason"):
                self.finished = True


def request_blocker(kind: Kind, req: dict[str, Any]) -> str:
    """Why a stream of this request cannot be continued elsewhere, whatever it sends ("" if it can)."""
    n = req.get("n")
    if n is not None and n != 1:
        return "several choices (n > 1)"
    if req.get("echo"):
        # A completion's echo repeats the prompt; vLLM's chat echo the last message: the partial answer.
        return "echo"
    if kind == "text":
        if not isinstance(req.get("prompt"), str):
            return "the prompt is not one string"
    elif not isinstance(req.get("messages"), list):
        return "no messages"
    return ""


@dataclass(frozen=True, slots=True)
class Continue:
    """Send ``body`` to another endpoint and splice its stream in."""

    body: bytes


@dataclass(frozen=True, slots=True)
class Close:
    """Nothing is left to generate: end the client's stream with ``tail``."""

    tail: bytes


@dataclass(frozen=True, slots=True)
class Refuse:
    """The stream cannot be continued."""

    reason: str


def plan(kind: Kind, req: dict[str, Any], sent: Sent) -> Continue | Close | Refuse:
    """What to do for a stream that broke after ``sent`` reached the client."""
    if sent.blocker:
        return Refuse(sent.blocker)
    if sent.done:
        return Close(b"")
    if sent.finished:
        # Only the usage event (if asked for) and [DONE] were lost; the usage is not known here.
        return Close(DONE)
    body = dict(req)
    for key in ("max_completion_tokens", "max_tokens"):
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            left = limit - sent.tokens
            if left < 1:
                return Close(_finish(kind, sent, "length") + DONE)
            body[key] = left
    text = "".join(sent.text)
    if kind == "text":
        body["prompt"] = req["prompt"] + text
    elif text:
        body["messages"] = [*req["messages"], {"role": "assistant", "content": text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return Continue(json.dumps(body).encode())


def _finish(kind: Kind, sent: Sent, reason: str) -> bytes:
    """The finishing event of an answer whose last token was sent (in OpenAI's field order)."""
    body: dict[str, Any] = {"delta": {}} if kind == "chat" else {"text": ""}
    choice = {"index": 0, **body, "logprobs": None, "finish_reason": reason}
    obj: dict[str, Any] = {"id": sent.id, "object": sent.object, "created": sent.created, "model": sent.model}
    obj["choices"] = [choice]
    if sent.usage_key:
        obj["usage"] = None
    return b"data: " + json.dumps(obj).encode() + SEP
