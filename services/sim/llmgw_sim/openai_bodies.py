"""OpenAI wire shapes for the simulated engine, the answer side: chat and completion bodies as vLLM
dumps them, their server-sent events (:class:`ChunkWriter`), usage, the model list. The text they carry
is :mod:`llmgw_sim.openai_api`'s.

Streaming chunks are rendered from a pre-built prefix with one ``json.dumps`` per token: the simulator
must never be the bottleneck of a router benchmark.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from llmgw_sim.lora import Adapter
from llmgw_sim.openai_api import GenRequest, finish_reason


def usage(prompt: int, completion: int) -> dict[str, Any]:
    """vLLM's UsageInfo as a whole response dumps it (the detail fields are null unless enabled)."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def usage_chunk(prompt: int, completion: int) -> dict[str, int]:
    """The usage of a stream's last chunk: vLLM drops its null fields there."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def fingerprint(model: str) -> str:
    """The ``system_fingerprint``: vLLM's names its version and a hash of its configuration."""
    return "llmgw-sim-" + hashlib.sha256(model.encode()).hexdigest()[:8]


def _tail(model: str) -> dict[str, Any]:
    return {"service_tier": None, "system_fingerprint": fingerprint(model)}


_VLLM_EXTRAS: dict[str, Any] = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def chat_message(text: str) -> dict[str, Any]:
    # vLLM leaves tool_calls out when there are none.
    return {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }


def chat_choice(index: int, text: str, reason: str) -> dict[str, Any]:
    return {
        "index": index,
        "message": chat_message(text),
        "logprobs": None,
        "finish_reason": reason,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }


def chat_body(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], prompt: int, completion: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        **_tail(model),
        "usage": usage(prompt, completion),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        **_VLLM_EXTRAS,
    }


def chat_response(rid: str, created: int, req: GenRequest, tokens: list[str]) -> dict[str, Any]:
    choice = chat_choice(0, "".join(tokens), finish_reason(req))
    return chat_body(rid, created, req.model, [choice], req.prompt_tokens, len(tokens))


def completion_response(rid: str, created: int, req: GenRequest, tokens: list[str]) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": "".join(tokens),
        "logprobs": None,
        "finish_reason": finish_reason(req),
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": [choice],
        **_tail(req.model),
        "usage": usage(req.prompt_tokens, len(tokens)),
        **_VLLM_EXTRAS,
    }


class ChunkWriter:
    """Renders the SSE events of one streamed answer, chat or text completion, as vLLM frames them.

    Each event is ``data: <json>\n\n``; the stream ends with ``data: [DONE]``. A chat stream opens
    with the role; the last token's chunk carries the finish reason (``token(text, last=True)``,
    as vLLM sends it); with ``include_usage`` a last chunk with empty choices carries the usage (vLLM
    leaves ``usage`` out of the others). A stream whose tokens were all written without ``last``
    gets the finish in a chunk of its own from :meth:`end`, as vLLM sends it when the last output
    has no text: the router's tests render whole streams that way.
    """

    __slots__ = ("_chat", "_finished", "_fp", "_head", "_last_post", "_req", "_tok_post", "_tok_pre")

    def __init__(self, rid: str, created: int, req: GenRequest, chat: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": req.model}
        # The constant part of every chunk, rendered once: '{"id":...,"model":"m","choices":'.
        self._head = "data: " + json.dumps(head)[:-1] + ', "choices": '
        self._req = req
        self._chat = chat
        self._finished = False
        # A token's event is this prefix, the JSON string of its text, and this suffix.
        field = '"delta": {"content": ' if chat else '"text": '
        self._tok_pre = self._head + '[{"index": 0, ' + field
        close = "}" if chat else ""
        # vLLM sets every field of a text completion's chunk; a chat chunk's stop_reason on the last only.
        extra = "" if chat else ', "stop_reason": null, "prompt_token_ids": null'
        self._tok_post = (
            close + ', "logprobs": null, "finish_reason": null' + extra + ', "token_ids": null}]}\n\n'
        )
        reason = json.dumps(finish_reason(req))
        # vLLM stamps its fingerprint on the stream's last message: the usage chunk when asked for,
        # else the chunk that finishes.
        self._fp = ', "system_fingerprint": ' + json.dumps(fingerprint(req.model))
        self._last_post = (
            close
            + f', "logprobs": null, "finish_reason": {reason}'
            + (', "stop_reason": null' if chat else extra)
            + ', "token_ids": null}]'
            + ("" if req.include_usage else self._fp)
            + "}\n\n"
        )

    def first(self) -> str:
        """The role announcement a chat stream opens with; nothing for text completions."""
        if not self._chat:
            return ""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._head + "[" + json.dumps(choice) + '], "prompt_token_ids": null, "prompt_text": null}\n\n'

    def token(self, text: str, last: bool = False) -> str:
        if last:
            self._finished = True
            return self._tok_pre + json.dumps(text) + self._last_post
        return self._tok_pre + json.dumps(text) + self._tok_post

    def end(self, completion: int) -> str:
        """The finishing chunk unless a token carried it, the usage chunk when asked for, ``[DONE]``."""
        out = ""
        if not self._finished:
            self._finished = True
            reason = finish_reason(self._req)
            empty: dict[str, Any] = {"delta": {}} if self._chat else {"text": ""}
            # The fields (and their order) of the finish llmgw's router writes when it closes a cut
            # stream itself, so that a spliced stream reads as one.
            last = {"index": 0, **empty, "logprobs": None, "finish_reason": reason}
            out += self._head + "[" + json.dumps(last) + "]}\n\n"
        if self._req.include_usage:
            u = json.dumps(usage_chunk(self._req.prompt_tokens, completion))
            out += self._head + '[], "usage": ' + u + self._fp + "}\n\n"
        return out + "data: [DONE]\n\n"


def model_list(
    model: str, max_model_len: int, instance: str, now: int, adapters: Sequence[Adapter] = ()
) -> dict[str, Any]:
    """``/v1/models`` as vLLM lists its model: a card with one permission entry; then a card per LoRA
    adapter loaded, its ``root`` the path it was loaded from, its ``parent`` the base."""
    permission = {
        "id": f"modelperm-{instance}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": model,
        "object": "model",
        "created": now,
        "owned_by": "llmgw-sim",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
    cards = [card]
    for i, adapter in enumerate(adapters, 1):
        cards.append(
            {
                **card,
                "id": adapter.name,
                "root": adapter.path,
                "parent": model,
                "max_model_len": None,
                "permission": [{**permission, "id": f"modelperm-{instance}-{i}"}],
            }
        )
    return {"object": "list", "data": cards}
