"""The key that sends requests sharing a prompt prefix to the same replica (prefix-aware routing).

Chat: the messages up to and including the first user message (the system prompt and the opening
question). Every later turn of a conversation sends them again unchanged, so all its turns share the key
and reach the replica whose KV cache holds their common prefix; a growing text prefix of fixed length
would not (turn 1 is shorter than turn 2). Completions: the first ``PREFIX_CHARS`` of the prompt.
Either is capped at ``PREFIX_CHARS``. Requests without a prompt (embeddings) have no key.
"""

from __future__ import annotations

from typing import Any

from llmgw_router.routing.scheduling import stable_id

PREFIX_CHARS = 4096


def _text(content: Any) -> str | None:
    """A message's text: a string, or the text parts of a list of content parts; None if neither."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return None


def prompt_key(req: dict[str, Any]) -> int | None:
    """The request's prefix key (a stable 64-bit hash), or None when it has no prompt to key on."""
    msgs = req.get("messages")
    if isinstance(msgs, list):
        parts: list[str] = []
        size = 0
        for m in msgs:
            if not isinstance(m, dict):
                return None
            text = _text(m.get("content"))
            if text is None:
                return None
            role = m.get("role")
            piece = f"{role}\x00{text}\x00"
            parts.append(piece)
            size += len(piece)
            if role == "user" or size >= PREFIX_CHARS:
                break
        return stable_id("".join(parts)[:PREFIX_CHARS]) if parts else None
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return stable_id(prompt[:PREFIX_CHARS])
    return None
