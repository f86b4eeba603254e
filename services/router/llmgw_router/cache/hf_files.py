"""The tokenizer's files a router needs, and what is read from them: the named special tokens and the
chat templates, found where transformers 5 looks for them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# The files a router needs, as the model directory names them (the agent publishes these).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
)

# transformers 5's named special tokens, the ones apply_chat_template hands to every template.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _json(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    raw = files.get(name)
    if raw is None:
        return {}
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as a config holds it: a string, or an AddedToken's dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def special_tokens(files: Mapping[str, bytes]) -> dict[str, str]:
    """The named special tokens transformers passes to a chat template (``bos_token``, ...): from
    ``tokenizer_config.json``, else ``special_tokens_map.json``, plus a multimodal tokenizer's named
    extra tokens (``image_token``, ...)."""
    config = _json(files, "tokenizer_config.json")
    mapped = _json(files, "special_tokens_map.json")
    out: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name, mapped.get(name)))
        if text is not None:
            out[name] = text
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        extra = config.get(key)
        if isinstance(extra, dict):
            for name, value in extra.items():
                text = _token_text(value)
                if text is not None:
                    out[str(name)] = text
    return out


def templates(files: Mapping[str, bytes]) -> tuple[str | None, str | dict[str, str] | None]:
    """(the processor's template, the tokenizer's template or named set)."""
    processor: str | None = None
    if "chat_template.json" in files:
        value = _json(files, "chat_template.json").get("chat_template")
        processor = value if isinstance(value, str) else None
    if "chat_template.jinja" in files:
        return processor, files["chat_template.jinja"].decode()
    config = _json(files, "tokenizer_config.json").get("chat_template")
    if isinstance(config, str):
        return processor, config
    if isinstance(config, list):
        named = {str(t["name"]): str(t["template"]) for t in config if isinstance(t, dict) and "name" in t}
        return processor, named or None
    return processor, None
