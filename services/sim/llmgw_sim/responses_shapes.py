"""OpenAI's Responses API as vLLM 0.32 shapes it, pure: the request read (:func:`read_request`), the
response object and its parts, the typed SSE events (:class:`EventWriter`). The routes and the store
are :mod:`llmgw_sim.responses_api`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw_sim import errors
from llmgw_sim import openai_api as oai

# Request fields a response echoes, with vLLM's defaults.
_ECHO: dict[str, Any] = {
    "instructions": None,
    "metadata": None,
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "max_tool_calls": None,
    "previous_response_id": None,
    "prompt": None,
    "reasoning": None,
    "service_tier": "auto",
    "text": None,
    "truncation": "disabled",
    "user": None,
}


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str
    words: tuple[str, ...]
    echo: dict[str, Any]
    max_output_tokens: int | None
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    temperature: float
    top_p: float


def _item_words(item: Any, i: int) -> list[str]:
    if not isinstance(item, dict):
        raise errors.invalid(f"input.{i}", "model_type", "Input should be a valid dictionary", item)
    words: list[str] = []
    for key in ("content", "output", "arguments"):
        value = item.get(key)
        if isinstance(value, str):
            words += value.split()
        elif isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    words += part["text"].split()
    return words


def read_request(body: dict[str, Any]) -> ResponsesRequest:
    model = oai.model_of(body)
    inp = body.get("input")
    if inp is None:
        raise errors.missing("input", body)
    if isinstance(inp, str):
        words = inp.split()
    elif isinstance(inp, list):
        words = [w for i, item in enumerate(inp) for w in _item_words(item, i)]
    else:
        raise errors.invalid("input", "string_type", "Input should be a valid string", inp)
    echo = {k: body.get(k, v) for k, v in _ECHO.items()}
    if isinstance(echo["instructions"], str):
        words = echo["instructions"].split() + words
    cap = body.get("max_output_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)):
        raise errors.invalid("max_output_tokens", "int_type", "Input should be a valid integer", cap)
    if cap is not None and cap < 1:
        raise errors.BadRequest(f"max_tokens must be at least 1, got {cap}.", "max_output_tokens")
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise errors.invalid("previous_response_id", "string_type", "Input should be a valid string", prev)
    temperature, top_p = body.get("temperature"), body.get("top_p")
    return ResponsesRequest(
        model=model,
        words=tuple(words),
        echo=echo,
        max_output_tokens=cap,
        stream=bool(body.get("stream")),
        store=body.get("store", True) is not False,
        background=bool(body.get("background")),
        previous_response_id=prev,
        temperature=float(temperature) if isinstance(temperature, (int, float)) else 1.0,
        top_p=float(top_p) if isinstance(top_p, (int, float)) else 1.0,
    )


def response_usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + completion,
    }


def output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def output_message(mid: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": mid,
        "content": parts,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def response_body(
    rid: str,
    created: int,
    model: str,
    req: ResponsesRequest,
    max_output_tokens: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The response object, every field vLLM's ``ResponsesResponse`` dumps, in its order."""
    e = req.echo
    return {
        "id": rid,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": e["instructions"],
        "metadata": e["metadata"],
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": e["parallel_tool_calls"],
        "temperature": req.temperature,
        "tool_choice": e["tool_choice"],
        "tools": e["tools"],
        "top_p": req.top_p,
        "background": req.background,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": e["max_tool_calls"],
        "previous_response_id": e["previous_response_id"],
        "prompt": e["prompt"],
        "reasoning": e["reasoning"],
        "service_tier": e["service_tier"],
        "status": status,
        "text": e["text"],
        "top_logprobs": None,
        "truncation": e["truncation"],
        "usage": usage,
        "user": e["user"],
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


# The response object of one request at a status, with its output and usage.
BodyOf = Callable[[str, list[dict[str, Any]], dict[str, Any] | None], dict[str, Any]]


class EventWriter:
    """The typed SSE events of one streamed response, numbered from 0."""

    def __init__(self) -> None:
        self.seq = 0

    def event(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data)}\n\n"
