"""Mid-stream failover, the stream as the client receives it: relayed by whole server-sent events, read
into the record of what was sent (``continuation.Sent``) when a migration needs it, and a continuation's
events spliced in.

A partial event is held back until its end arrives, so a stream cut in the middle of an event never
shows the client half of it. The events relayed are kept as they are (no parsing on the normal path) and
read only when a migration needs them, or once they pass ``FOLD_BYTES`` (long answers then cost one parse
per ``FOLD_BYTES``, not unbounded memory). A continuation's events are rewritten to the first stream's
``id``/``created``/``model``, its role announcement is dropped, and its usage becomes the first
request's: prompt tokens less the ones it re-sent, completion tokens plus them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmgw_router.failover.continuation import DONE, SEP, Sent

# Relayed bytes kept raw per stream before they are folded into the record of what was sent.
FOLD_BYTES = 64 * 1024
# A partial event held back longer than this is not an event: the stream passes through untouched.
HOLD_BYTES = 64 * 1024


class Unframed(Exception):
    """A continuation whose bytes are not blank-line separated events: it cannot be spliced."""


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
    events = blob.count(SEP)
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
    return [e for e in data.split(SEP) if e]


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
        end = data.rfind(SEP)
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
            end = blob.find(SEP) + 2 or len(blob)
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
                out.append(event + SEP)
                continue
            if payload == b"[DONE]":
                s.done = True
                out.append(DONE)
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                out.append(event + SEP)
                continue
            if not isinstance(obj, dict):
                out.append(event + SEP)
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
            out.append(b"data: " + json.dumps(obj).encode() + SEP)
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
