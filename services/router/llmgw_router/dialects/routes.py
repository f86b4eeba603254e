"""The proxied paths, one table: which API family each belongs to and that family's dialect (its body,
its error shape, its stored ids, its continuation: ``dialect.py``). Read by ``app.py`` to build the
handlers (vLLM 0.32's surface, checked against its routers; llama.cpp serves a subset,
``llmgw_common.apis``)."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_common.apis import Api
from llmgw_router.dialects.dialect import (
    AUDIO,
    CHAT,
    CHAT_BATCH,
    COMPLETIONS,
    MESSAGES,
    OPENAI,
    RESPONSES,
    Dialect,
)


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    api: Api
    dialect: Dialect = OPENAI


PROXIED: tuple[Route, ...] = (
    Route("/v1/chat/completions", Api.CHAT, CHAT),
    Route("/v1/chat/completions/batch", Api.CHAT, CHAT_BATCH),
    Route("/v1/completions", Api.COMPLETIONS, COMPLETIONS),
    Route("/v1/responses", Api.RESPONSES, RESPONSES),
    Route("/v1/messages", Api.MESSAGES, MESSAGES),
    Route("/v1/messages/count_tokens", Api.MESSAGES, MESSAGES),
    Route("/v1/embeddings", Api.EMBEDDINGS),
    Route("/v2/embed", Api.EMBEDDINGS),
    Route("/pooling", Api.POOLING),
    Route("/classify", Api.CLASSIFY),
    Route("/score", Api.SCORE),
    Route("/v1/score", Api.SCORE),
    Route("/rerank", Api.RERANK),
    Route("/v1/rerank", Api.RERANK),
    Route("/v2/rerank", Api.RERANK),
    Route("/tokenize", Api.TOKENIZE),
    Route("/detokenize", Api.TOKENIZE),
    Route("/v1/audio/transcriptions", Api.AUDIO, AUDIO),
    Route("/v1/audio/translations", Api.AUDIO, AUDIO),
)

# GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: routed by the id, to the replica storing it.
STORED_PREFIX = "/v1/responses/"
CANCEL_SUFFIX = "/cancel"
