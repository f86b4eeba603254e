"""The proxied paths: which API family each belongs to, the dialect of its errors, how its body names
the model. One table, read by ``app.py`` to build the handlers (vLLM 0.32's surface, checked against its
routers; llama.cpp serves a subset, ``llmgw_common.apis``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from llmgw_common.apis import Api


class Dialect(Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class BodyKind(Enum):
    JSON = "json"
    MULTIPART = "multipart"  # audio: ``model`` is a form field


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    api: Api
    dialect: Dialect = Dialect.OPENAI
    body: BodyKind = BodyKind.JSON
    # Answers carry ids of responses the replica stores (Responses API): tagged with the replica.
    stores: bool = False


PROXIED: tuple[Route, ...] = (
    Route("/v1/chat/completions", Api.CHAT),
    Route("/v1/chat/completions/batch", Api.CHAT),
    Route("/v1/completions", Api.COMPLETIONS),
    Route("/v1/responses", Api.RESPONSES, stores=True),
    Route("/v1/messages", Api.MESSAGES, Dialect.ANTHROPIC),
    Route("/v1/messages/count_tokens", Api.MESSAGES, Dialect.ANTHROPIC),
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
    Route("/v1/audio/transcriptions", Api.AUDIO, body=BodyKind.MULTIPART),
    Route("/v1/audio/translations", Api.AUDIO, body=BodyKind.MULTIPART),
)

# GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: routed by the id, to the replica storing it.
STORED_PREFIX = "/v1/responses/"
CANCEL_SUFFIX = "/cancel"
