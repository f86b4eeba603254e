"""Mid-stream failover, the pure part: what a client has been sent of a stream, the request that
continues it elsewhere, and the continuation spliced into the client's stream.

A stream is relayed by whole server-sent events: a partial event is held back until its end arrives,
so a stream cut in the middle of an event never shows the client half of it. The events relayed are
kept as they are (no parsing on the normal path) and read only when a migration needs them, or once
they pass ``FOLD_BYTES`` (long answers then cost one parse per ``FOLD_BYTES``, not unbounded memory).

The continuation is the original request with the text sent so far: for chat, a final assistant
message with ``continue_final_message: true, add_generation_prompt: false`` (vLLM's flags; llama.cpp
continues a final assistant message by default and ignores them); for completions, the prompt plus the
text. ``max_tokens`` (or ``max_completion_tokens``) is reduced by the tokens sent. Its events are
rewritten to the first stream's ``id``/``created``/``model``, its role announcement is dropped, and its
usage becomes the first request's: prompt tokens less the ones it re-sent, completion tokens plus them.

Not continued (the stream ends as before, a 502 in the metrics): several choices (``n`` > 1), tool
calls or reasoning text in the answer (they cannot be handed back as a partial message), ``echo``,
and a prompt that is not one string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "text"]
KINDS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "text"}
# Relayed bytes kept raw per stream before they are folded into the record of what was sent.
FOLD_BYTES = 64 * 1024
# A partial event held back longer than this is not an event: the stream passes through untouched.
HOLD_BYTES = 64 * 1024
# Text of one answer kept for a continuation; a longer answer is not continued (nor kept: an engine that
# streams without end would otherwise grow the router without bound).
MAX_TEXT_CHARS = 1 << 20
# Tokens of text joined into one string in the record (a fold joins all it read as well).
_JOIN_EVERY = 128
DONE = b"data: [DONE]\n\n"
_SEP = b"\n\n"


class Unframed(Exception):
    """A continuation whose bytes are not blank-line separated events: it cannot be spliced."""


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


# The fast path of folding (a long stream folds every FOLD_BYTES): events of text only, read with
# regular expressions instead of one json.loads each (about 5 times faster). Anything else in the bytes
# (usage, tool calls, reasoning, other choices, lines other than data) takes the full path. A key cannot
# match inside a JSON string: a quote there is always escaped. Each pattern starts with a literal, which
# the regex engine finds at C speed (an alternation of them was 100 times slower).
_CONTENT = re.compile(r'"content"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"')
_TEXT = re.compile(r'"text"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"')
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"')
_NOT_PLAIN = (re.compile(rb'"usage"\s*:\s*\{'), re.compile(rb'"index"\s*:\s*[1-9]'))
_NOT_PLAIN_WORDS = (b"tool_calls", b"function_call", b'"reasoning')


def _plain(blob: bytes) -> bool:
    """Events that hold nothing but text, role and finish of choice 0 (and [DONE])."""
    if not blob.startswith(b"data: ") or any(w in blob for w in _NOT_PLAIN_WORDS):
        return False
    # One line per event, each a data line: no other field, no comment.
    events = blob.count(_SEP)
    if blob.count(b"\n") != 2 * events or blob.count(b"\n\ndata: ") != events - 1:
        return False
    if b'"content"' in blob and b'"text"' in blob:
        return False
    return not any(p.search(blob) for p in _NOT_PLAIN)


def _fold_plain(sent: Sent, blob: bytes) -> None:
    text = blob.decode("utf-8", "replace")
    found = [
        json.loads('"' + lit + '"') if "\\" in lit else lit
        for lit in (_CONTENT if '"content"' in text else _TEXT).findall(text)
        if lit
    ]
    if found:
        sent.add_texts(found)
    if _FINISH.search(blob):
        sent.finished = True
    if b'"role"' in blob:
        sent.role = True
    if b"data: [DONE]" in blob:
        sent.done = True
    if b'"usage"' in blob:
        sent.usage_key = True


def _events(data: bytes) -> list[bytes]:
    return [e for e in data.split(_SEP) if e]


def _payload(event: bytes) -> bytes | None:
    """The data of an event with one ``data:`` line; None for anything else (comments, other fields)."""
    if not event.startswith(b"data:") or b"\n" in event:
        return None
    return event[5:].strip()


class Relay:
    """One stream as the client receives it, whole events at a time, across migrations.

    :meth:`relay` takes an engine's bytes and returns what to write to the client now. Before the first
    migration the bytes pass unchanged (only a partial event's tail is held back); afterwards each event
    is parsed and rewritten (:meth:`splice`).
    """

    __slots__ = ("_base", "_held", "_raw", "_raw_bytes", "_splicing", "ended", "sent", "through")

    def __init__(self) -> None:
        self.sent = Sent()
        self._held = b""
        self._raw: list[bytes] = []
        self._raw_bytes = 0
        self._splicing = False
        # Tokens already sent when the current continuation was asked for: its usage is shifted by them.
        self._base = 0
        # The last event relayed was ``[DONE]``.
        self.ended = False
        # Not events as expected (no blank line in HOLD_BYTES): passed through untouched, never continued.
        self.through = False

    def relay(self, data: bytes) -> bytes:
        if self.through:
            return data
        if self._held:
            data = self._held + data
            self._held = b""
        end = data.rfind(_SEP)
        if end < 0:
            if len(data) > HOLD_BYTES:
                # Events that do not end in a blank line ("\r\n\r\n"?): stop holding anything back.
                self.sent.blocker = "events not separated by a blank line"
                if self._splicing:
                    # A continuation is rewritten event by event: it cannot pass through, and holding
                    # it would grow without bound.
                    raise Unframed(f"no event separator in {len(data)} bytes of the continuation")
                self.through = True
                return data
            self._held = data
            return b""
        if end + 2 < len(data):
            self._held = data[end + 2 :]
            data = data[: end + 2]
        if self._splicing:
            return self._rewrite(data)
        self.ended = data.endswith(DONE)
        self._raw.append(data)
        self._raw_bytes += len(data)
        if self._raw_bytes > FOLD_BYTES:
            self.fold()
        return data

    def fold(self) -> Sent:
        """Read the events relayed so far into :attr:`sent`."""
        if self.through:
            return self.sent
        raw, self._raw, self._raw_bytes = self._raw, [], 0
        blob = b"".join(raw)
        before = len(self.sent.text)
        try:
            self._fold(blob)
        finally:
            # One string per fold, not one per token (~60 bytes of object each).
            text = self.sent.text
            if len(text) - before > 1:
                text[before:] = ["".join(text[before:])]
        return self.sent

    def _fold(self, blob: bytes) -> None:
        if self.sent.id is None:
            # The first event names the stream (id, created, model): parsed in full.
            end = blob.find(_SEP) + 2 or len(blob)
            for event in _events(blob[:end]):
                self._observe(event)
            blob = blob[end:]
        if _plain(blob):
            _fold_plain(self.sent, blob)
            return
        for event in _events(blob):
            self._observe(event)

    def _observe(self, event: bytes) -> dict[str, Any] | None:
        payload = _payload(event)
        if payload is None:
            return None
        if payload == b"[DONE]":
            self.sent.done = True
            return None
        try:
            obj = json.loads(payload)
        except ValueError:
            self.sent.blocker = "an event that is not JSON"
            return None
        if not isinstance(obj, dict):
            self.sent.blocker = "an event that is not OpenAI's shape"
            return None
        self.sent.observe(obj)
        return obj

    def splice(self) -> None:
        """A continuation starts: drop the broken stream's partial event; rewrite what comes next."""
        self.fold()
        self._held = b""
        self._splicing = True
        self._base = self.sent.tokens

    def _rewrite(self, data: bytes) -> bytes:
        out: list[bytes] = []
        s = self.sent
        for event in _events(data):
            if s.done:
                break  # the client's stream has ended: an engine's second [DONE], or more, is dropped
            payload = _payload(event)
            if payload is None:
                out.append(event + _SEP)
                continue
            if payload == b"[DONE]":
                s.done = True
                out.append(DONE)
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                out.append(event + _SEP)
                continue
            if not isinstance(obj, dict):
                out.append(event + _SEP)
                continue
            if s.id is not None:
                for k in ("id", "created", "model"):
                    if k in obj:
                        obj[k] = getattr(s, k)
            if s.role and _drop_role(obj):
                continue
            u = obj.get("usage")
            if isinstance(u, dict) and isinstance(u.get("prompt_tokens"), int):
                p = max(u["prompt_tokens"] - self._base, 0)
                c = int(u.get("completion_tokens") or 0) + self._base
                obj["usage"] = {**u, "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
            s.observe(obj)
            out.append(b"data: " + json.dumps(obj).encode() + _SEP)
        self.ended = s.done
        return b"".join(out)


def _drop_role(obj: dict[str, Any]) -> bool:
    """Remove a repeated role announcement from a chat event; True when nothing else is left in it."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    c = choices[0]
    delta = c.get("delta")
    if not isinstance(delta, dict) or "role" not in delta:
        return False
    del delta["role"]
    empty = not any(delta.values()) and not c.get("finish_reason") and not obj.get("usage")
    return empty


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
    return b"data: " + json.dumps(obj).encode() + _SEP
