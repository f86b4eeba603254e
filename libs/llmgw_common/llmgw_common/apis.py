"""The APIs a model serves: what an engine answers, named once for the catalog and the router.

An :class:`Api` is a family of HTTP endpoints that an engine serves together or not at all (vLLM
registers its routes per task: a pooling model has no chat route, a generate model no ``/pooling``).
A catalog entry may list its ``apis``; without a list they follow from the engine and its flags
(:func:`served_apis`), so a typical catalog says nothing and an embedding model asked to chat gets a
clear 404 from the router instead of a 502 or the engine's bare ``Not Found``.

The derivation only rules out what the engine surely does not serve. Finer refusals (``/classify`` on
an embedding model, transcription on a text model) are the engine's own 4xx, relayed as it sent them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any


class Api(StrEnum):
    CHAT = "chat"  # /v1/chat/completions, /v1/chat/completions/batch
    COMPLETIONS = "completions"  # /v1/completions
    RESPONSES = "responses"  # /v1/responses (+ GET /v1/responses/{id}, /cancel)
    MESSAGES = "messages"  # Anthropic's /v1/messages (+ /count_tokens)
    EMBEDDINGS = "embeddings"  # /v1/embeddings, /v2/embed
    POOLING = "pooling"  # /pooling
    CLASSIFY = "classify"  # /classify
    SCORE = "score"  # /score, /v1/score
    RERANK = "rerank"  # /rerank, /v1/rerank, /v2/rerank
    TOKENIZE = "tokenize"  # /tokenize, /detokenize
    AUDIO = "audio"  # /v1/audio/transcriptions, /v1/audio/translations (multipart)


GENERATE_APIS = frozenset({Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.MESSAGES, Api.TOKENIZE, Api.AUDIO})
POOLING_APIS = frozenset({Api.EMBEDDINGS, Api.POOLING, Api.CLASSIFY, Api.SCORE, Api.RERANK, Api.TOKENIZE})
ALL_APIS = frozenset(Api)

# vLLM's runners and the pooling tasks of its older ``--task`` flag.
_VLLM_POOLING_TASKS = frozenset({"pooling", "embed", "embedding", "classify", "score", "reward"})
# llama-server (pinned in the Makefile; its tools/server/server.cpp registers the routes): chat,
# completions, a stateless Responses API (it refuses previous_response_id), Anthropic Messages (+
# count_tokens), tokenize/detokenize, and transcription for an audio model. ``--embedding(s)`` makes it
# an embedding server ("restrict to only support embedding use case"), ``--reranking`` a reranker
# (rank pooling, embedding on).
_LLAMA_GENERATE = frozenset({Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.MESSAGES, Api.TOKENIZE, Api.AUDIO})


def _flag_value(args: Sequence[str], *names: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` for the last such flag in ``args``."""
    found = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(n + "="):
                found = a[len(n) + 1 :]
    return found


def _has_flag(args: Sequence[str], *names: str) -> bool:
    return any(a in names or any(a.startswith(n + "=") for n in names) for a in args)


def derived_apis(engine: str, args: Sequence[str], options: Mapping[str, Any]) -> frozenset[Api]:
    """What an engine started with these flags serves (see the module's docstring)."""
    if engine == "vllm":
        runner = _flag_value(args, "--runner") or _flag_value(args, "--task") or ""
        return POOLING_APIS if runner in _VLLM_POOLING_TASKS else GENERATE_APIS
    if engine == "llamacpp":
        if _has_flag(args, "--reranking", "--rerank"):
            return frozenset({Api.RERANK, Api.TOKENIZE})
        if _has_flag(args, "--embedding", "--embeddings"):
            return frozenset({Api.EMBEDDINGS, Api.TOKENIZE})
        return _LLAMA_GENERATE
    if engine == "sim":
        # The simulator acts as a vLLM pooling or generate runner when its ``runner`` option says which,
        # and serves everything otherwise (a dev cluster's one model answers every client).
        role = options.get("runner")
        return POOLING_APIS if role == "pooling" else GENERATE_APIS if role == "generate" else ALL_APIS
    return ALL_APIS


def served_apis(
    engine: str, args: Sequence[str], options: Mapping[str, Any], declared: Iterable[Api] | None
) -> frozenset[Api]:
    """The catalog's ``apis`` when it lists them, else :func:`derived_apis`."""
    if declared is not None:
        return frozenset(declared)
    return derived_apis(engine, args, options)
