"""A request's messages as vLLM rebuilds them before rendering (its ``renderers/chat_utils.py``), and
transformers' ``continue_final_message`` tag; :class:`Unpredictable` where the tokens cannot be known."""

from __future__ import annotations

import json
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

# vLLM's content part types read as text, and the key holding each one's text.
_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# The fields vLLM knows in a content part (its _KNOWN_CONTENT_PART_FIELDS): any other field of a text part
# is kept beside its text in the openai format.
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
# Claude Code's first system line changes on every request; vLLM drops it (a prefix-cache killer).
_BILLING_HEADER = "x-anthropic-billing-header"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class Unpredictable(Exception):
    """This request's tokens cannot be known here (the router routes it on load alone)."""


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text = (
            part
            if isinstance(part, str)
            else part.get("text")
            if isinstance(part, dict) and part.get("type") == "text"
            else None
        )
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _content(role: str, content: Any, fmt: ContentFormat) -> str | list[dict[str, Any]]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise Unpredictable
    if role == "system":
        parts = _strip_billing_header(parts)
    texts: list[str] = []
    wrapped: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            wrapped.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict) or part.get("uuid") is not None:
            raise Unpredictable
        part_type = part.get("type")
        key = _TEXT_PART_KEYS.get(part_type) if isinstance(part_type, str) else None
        if key is None:
            raise Unpredictable  # media, tool references, unknown parts
        text = part.get(key)
        if text is None and part_type in ("text", "refusal"):
            continue  # vLLM skips a text part without text
        if not isinstance(text, str):
            raise Unpredictable
        texts.append(text)
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
        wrapped.append({"type": "text", "text": text, **extra})
    return wrapped if fmt == "openai" else "\n".join(texts)


def _tool_calls(calls: Any) -> list[Any] | None:
    if not isinstance(calls, list):
        raise Unpredictable
    if not calls:
        return None  # vLLM drops an empty list
    out: list[Any] = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise Unpredictable  # vLLM refuses these
        args = function.get("arguments")
        if not args:
            parsed: Any = {}
        elif isinstance(args, str):
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = {}
        else:
            parsed = args
        out.append(
            {**call, "function": {**function, "arguments": parsed if isinstance(parsed, dict) else {}}}
        )
    return out


def conversation(messages: list[Any], fmt: ContentFormat) -> list[dict[str, Any]]:
    """The messages a chat template sees, as vLLM's ``parse_chat_messages`` builds them."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(role := message.get("role"), str):
            raise Unpredictable
        msg: dict[str, Any] = {"role": role, "content": _content(role, message.get("content"), fmt)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                calls = _tool_calls(message["tool_calls"])
                if calls is not None:
                    msg["tool_calls"] = calls
            if (reasoning := message.get("reasoning")) is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if isinstance(msg["content"], list):  # vLLM flattens a tool result's text parts
                msg["content"] = "\n".join(p["text"] for p in msg["content"])
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if isinstance(message.get("task"), str):
            msg["task"] = message["task"]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out


def without_developer(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``developer`` -> ``system`` for templates without that role, system turns then merged."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
        for m in messages
    ]
    systems: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else str(p) for p in content)
        if content:
            systems.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *others]


def tag_final(chat: list[dict[str, Any]], source: str) -> tuple[str, list[dict[str, Any]]]:
    """transformers' continue_final_message: a tag after the last message's text, cut off after render."""
    if "content" not in source:
        raise Unpredictable
    last = dict(chat[-1])
    content = last.get("content")
    if isinstance(content, list):
        parts = [dict(p) for p in content]
        for part in reversed(parts):
            if "text" in part:
                final = str(part["text"])
                part["text"] = final + _CONTINUE_TAG
                break
        else:
            raise Unpredictable
        last["content"] = parts
    elif isinstance(content, str):
        final = content
        last["content"] = content + _CONTINUE_TAG
    else:
        raise Unpredictable
    return final, [*chat[:-1], last]


def cut_at_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise Unpredictable
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()
